"""`hf-sparse` command line: generate with a sparse method, and report fidelity against dense attention."""
from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
import time
from typing import Any, Sequence

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from ..config import CONFIG_CLASSES
from ..gate_files import GateFileError, load_gates
from ..gates import set_gates
from ..integration import configure
from ..recording import record_sparsity
from ..rope_scaling import apply_yarn
from .default_model import default_model_dir, load_default_model
from .eval import compare_table, fidelity
from .gate_training import add_train_gates_command
from .key_scorer_fit import add_fit_key_scorer_command
from .long_context import add_train_long_context_command

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _parse_scalar(text: str) -> Any:
    lowered = text.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    for parse in (int, float):
        try:
            return parse(text)
        except ValueError:
            pass
    return text


def _parse_value(text: str) -> Any:
    if text.lower() == "none":
        return None
    if "," in text:
        return tuple(int(part) for part in text.split(",") if part)
    return _parse_scalar(text)


def config_from_overrides(overrides: Sequence[str], method: str = "plas") -> Any:
    """The method's config (``PLASConfig`` for "plas", …) from ``field=value`` strings (``prefill_top_k=4,6``,
    ``threshold=0.9``, ``dense_below=none``)."""
    cls = CONFIG_CLASSES[method]
    fields = {f.name for f in dataclasses.fields(cls) if f.init}
    values: dict[str, Any] = {}
    for item in overrides:
        name, sep, raw = item.partition("=")
        if not sep or name not in fields:
            raise SystemExit(f"--set expects field=value with a {cls.__name__} field ({', '.join(sorted(fields))}); "
                             f"got {item!r}")
        try:
            values[name] = _parse_value(raw)
        except ValueError:
            raise SystemExit(f"--set {name}: cannot parse {raw!r} (integers, comma-separated pairs or 'none')") from None
    try:
        return cls(**values)
    except ValueError as error:
        raise SystemExit(f"invalid configuration: {error}") from None


def _model_path(model_name: str) -> str:

    return str(default_model_dir()) if model_name == "default" else model_name


def _rope_factor(text: str | None) -> float | None:
    """The YaRN factor of ``--rope-scaling yarn:FACTOR`` (None when the flag is absent)."""
    if text is None:
        return None
    kind, _, value = text.partition(":")
    try:
        factor = float(value)
    except ValueError:
        factor = 0.0
    if kind != "yarn" or not factor >= 1.0:
        raise SystemExit(f"--rope-scaling expects yarn:FACTOR with a factor >= 1 (e.g. yarn:4), got {text!r}")
    return factor


def _load(args: argparse.Namespace, max_length: int | None = None):
    """The model on its device. ``--model default``: YaRN with the factor ``max_length`` (prompt and new tokens)
    needs past 8K, or the long-context default with ``--long-context`` (``load_default_model``); any model:
    ``--rope-scaling yarn:FACTOR``."""

    factor = _rope_factor(args.rope_scaling)
    if args.long_context and (args.model != "default" or factor is not None):
        raise SystemExit("--long-context gives the long-context default model: use it with --model default and "
                         "without --rope-scaling")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.model == "default" and factor is None:
        try:
            model, _ = load_default_model("sdpa", _DTYPES[args.dtype], max_length=max_length,
                                          long_context=args.long_context)
        except FileNotFoundError as error:
            raise SystemExit(str(error)) from None
    else:
        path = _model_path(args.model)
        kwargs = {}
        if factor is not None:
            try:
                kwargs["config"] = apply_yarn(AutoConfig.from_pretrained(path), factor=factor)
            except ValueError as error:
                raise SystemExit(f"--rope-scaling: {error}") from None
        model = AutoModelForCausalLM.from_pretrained(path, dtype=_DTYPES[args.dtype], attn_implementation="sdpa",
                                                     **kwargs)
    return model.to(device).eval(), device


def _load_tokenizer(args: argparse.Namespace):

    return AutoTokenizer.from_pretrained(_model_path(args.model))


def _read_text(args: argparse.Namespace) -> str:
    if args.prompt is not None:
        return args.prompt
    with open(args.prompt_file, encoding="utf-8") as handle:
        return handle.read()


def _add_common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="default", help="local folder or Hub id; 'default' = embedded SmolLM2-135M")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt-file", help="text file with the prompt / input")
    source.add_argument("--prompt", help="the prompt itself")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                        help="override of the method's config (PLASConfig, XAttnConfig, StarConfig)")
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default="float32")
    parser.add_argument("--device", default=None)
    parser.add_argument("--long-context", action="store_true",
                        help="with --model default: the long-context default model (YaRN + the shipped adapter)")
    parser.add_argument("--rope-scaling", default=None, metavar="yarn:FACTOR",
                        help="YaRN rope scaling for any model (factor = length / trained length); --model default "
                             "picks it from the prompt's length when this is not given")


def _generate(args: argparse.Namespace) -> int:

    sparse = args.method in CONFIG_CLASSES
    config = config_from_overrides(args.set, args.method) if sparse else None
    tokenizer = _load_tokenizer(args)
    text = _read_text(args)
    if args.chat:
        text = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)
    inputs = tokenizer(text, return_tensors="pt")
    model, device = _load(args, inputs.input_ids.shape[1] + args.max_new_tokens)
    if sparse:
        configure(model, config)
    inputs = inputs.to(device)
    with torch.no_grad(), record_sparsity() as recorder:
        start = time.perf_counter()
        output = model.generate(**inputs, max_new_tokens=args.max_new_tokens, do_sample=False)
        elapsed = time.perf_counter() - start
    print(tokenizer.decode(output[0, inputs.input_ids.shape[1]:], skip_special_tokens=True))
    summary = f"[{args.method}] {inputs.input_ids.shape[1]} prompt tokens, {elapsed:.2f} s"
    if sparse:
        summary += f", density prefill {recorder.density('prefill'):.3f} decode {recorder.density('decode'):.3f}"
        dense = recorder.dense_layers()
        if dense:
            summary += f", dense layers {sorted(dense)} ({'; '.join(sorted(set(dense.values())))})"
    print(summary, file=sys.stderr)
    return 0


def _eval(args: argparse.Namespace) -> int:

    config = config_from_overrides(args.set, args.method)
    tokenizer = _load_tokenizer(args)
    ids = tokenizer(_read_text(args), return_tensors="pt").input_ids
    if args.tokens:
        if ids.shape[1] < args.tokens:
            raise SystemExit(f"the input has {ids.shape[1]} tokens, fewer than --tokens {args.tokens}")
        ids = ids[:, : args.tokens]
    model, device = _load(args, ids.shape[1])
    if not args.gates:
        report = fidelity(model, ids.to(device), config, last_n=args.last_n, with_recall=not args.no_recall)
        print(report.table())
        return 0
    if args.method != "plas":
        raise SystemExit("--gates compares PLAS gate files: use --method plas")

    configure(model, config)  # the gate file must match this block size
    try:
        load_gates(model, args.gates, strict=True)
    except GateFileError as error:
        raise SystemExit(f"--gates: {error}") from None
    gated = fidelity(model, ids.to(device), config, last_n=args.last_n, with_recall=not args.no_recall)
    set_gates(model, None)
    mean = fidelity(model, ids.to(device), config, last_n=args.last_n, with_recall=not args.no_recall)
    print(compare_table({"mean pooling": mean, f"gates {args.gates}": gated}))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-sparse", description="Sparse attention for transformers models")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging (which layers ran dense and why)")
    commands = parser.add_subparsers(dest="command", required=True)
    generate = commands.add_parser("generate", help="generate text with a sparse (or dense) attention method")
    _add_common(generate)
    generate.add_argument("--method", choices=[*CONFIG_CLASSES, "sdpa"], default="plas")
    generate.add_argument("--max-new-tokens", type=int, default=64)
    generate.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    generate.set_defaults(run=_generate)
    evaluate = commands.add_parser("eval", help="fidelity of sparse vs dense attention on one input")
    _add_common(evaluate)
    evaluate.add_argument("--method", choices=list(CONFIG_CLASSES), default="plas")
    evaluate.add_argument("--tokens", type=int, default=0, help="truncate the input to this many tokens")
    evaluate.add_argument("--last-n", type=int, default=256, help="positions scored for KL / top-1")
    evaluate.add_argument("--no-recall", action="store_true", help="skip the (slow) attention-recall pass")
    evaluate.add_argument("--gates", metavar="FILE_OR_FOLDER_OR_REPO",
                          help="PLAS: evaluate with this gate file too and print it beside mean pooling")
    evaluate.set_defaults(run=_eval)

    add_train_gates_command(commands)
    add_train_long_context_command(commands)
    add_fit_key_scorer_command(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING, format="%(name)s: %(message)s")
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
