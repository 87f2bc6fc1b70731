"""Rope scaling: YaRN parameters for a target length, applied to a config, and the warning for prompts past a
model's trained length.

A model trained to ``max_position_embeddings`` tokens with plain rotary embeddings (``rope_type="default"``) sees
positions it never saw beyond that length, and its output degrades into noise. YaRN (``rope_type="yarn"``)
interpolates the low rotary frequencies by ``factor = target length / trained length`` and keeps the high ones,
which keeps such a model sane without training. transformers (5.17 and later) reads the parameters from
``config.rope_parameters`` when it builds the model's rotary embedding, so they must be set on the config
*before* the model is created::

    config = AutoConfig.from_pretrained(name)
    hf_sparse.rope_scaling.apply_yarn(config, 32768)
    model = AutoModelForCausalLM.from_pretrained(name, config=config)
"""
from __future__ import annotations

import copy
import json
import logging
import math
import weakref
from typing import Any

logger = logging.getLogger(__name__)

#: Rope types whose ``original_max_position_embeddings`` is the length the model was trained to.
_ORIGINAL_LENGTH_TYPES = ("yarn", "llama3", "longrope")
#: The types of plain rotary embeddings (no scaling).
_UNSCALED_TYPES = (None, "default")


def rope_parameters(config: Any) -> dict[str, Any]:
    """A copy of the config's flat ``rope_parameters`` dict (``{}`` when it has none); a model with different
    rope parameters per layer type (a nested dict) is refused."""
    parameters = getattr(config, "rope_parameters", None) or {}
    if not isinstance(parameters, dict):
        raise TypeError(f"config.rope_parameters must be a dict, got {type(parameters).__name__}")
    if any(isinstance(value, dict) for value in parameters.values()):
        raise ValueError("this model has rope parameters per layer type (a nested config.rope_parameters); "
                         "hf_sparse.rope_scaling handles one flat dict only")
    return copy.deepcopy(parameters)


def rope_type(config: Any) -> str:
    """The config's rope type (``"default"`` when none is set)."""
    parameters = rope_parameters(config)
    return parameters.get("rope_type", parameters.get("type")) or "default"


def has_rope_scaling(config: Any) -> bool:
    """Whether the config sets any rope scaling (a rope type other than ``"default"``)."""
    return rope_type(config) not in _UNSCALED_TYPES


def trained_length(config: Any) -> int:
    """The length the model was trained to: ``original_max_position_embeddings`` of a YaRN / Llama-3 / LongRoPE
    config, else ``max_position_embeddings``."""
    parameters = rope_parameters(config)
    if rope_type(config) in _ORIGINAL_LENGTH_TYPES and parameters.get("original_max_position_embeddings"):
        return int(parameters["original_max_position_embeddings"])
    length = getattr(config, "max_position_embeddings", None)
    if not isinstance(length, int) or length < 1:
        raise ValueError(f"the config has no max_position_embeddings (got {length!r}): cannot tell its trained length")
    return length


def yarn_factor(target_length: int, trained: int, *, whole: bool = False) -> float:
    """``target_length / trained``, never below 1; ``whole=True`` rounds it up to a whole number (so the scaled
    model covers at least ``target_length`` tokens and the factor is one of 1, 2, 3, ...)."""
    if not isinstance(target_length, int) or target_length < 1:
        raise ValueError(f"target_length must be a positive integer, got {target_length!r}")
    if not isinstance(trained, int) or trained < 1:
        raise ValueError(f"the trained length must be a positive integer, got {trained!r}")
    factor = max(1.0, target_length / trained)
    return float(math.ceil(factor)) if whole else factor


def yarn_parameters(config: Any, target_length: int | None = None, *, factor: float | None = None,
                    whole: bool = False) -> dict[str, Any]:
    """The ``rope_parameters`` dict of YaRN for ``config`` (its ``rope_theta`` and any ``partial_rotary_factor``
    kept) at ``factor``, or at the factor ``target_length`` needs (:func:`yarn_factor`; ``whole`` rounds it up to a
    whole number). The trained length is :func:`trained_length`, so a config that already has YaRN is rescaled
    from its original length. Configs with another scaling (``llama3``, ``longrope``, ``linear``, ``dynamic``) are
    refused: they already extend the model's context in their own way."""
    if (target_length is None) == (factor is None):
        raise ValueError("give exactly one of target_length and factor")
    kind = rope_type(config)
    if kind not in (*_UNSCALED_TYPES, "yarn"):
        raise ValueError(f"the config already has rope_type={kind!r} scaling; YaRN is applied to models with plain "
                         "rotary embeddings (rope_type 'default') or rescales an existing YaRN")
    trained = trained_length(config)
    if factor is None:
        factor = yarn_factor(target_length, trained, whole=whole)
    elif not isinstance(factor, (int, float)) or not math.isfinite(factor) or factor < 1:
        raise ValueError(f"the YaRN factor must be a number >= 1, got {factor!r}")
    current = rope_parameters(config)
    theta = current.get("rope_theta", getattr(config, "rope_theta", None))
    if theta is None:
        raise ValueError("the config has no rope_theta: cannot build its YaRN parameters")
    parameters: dict[str, Any] = {"rope_type": "yarn", "factor": float(factor),
                                  "original_max_position_embeddings": trained, "rope_theta": float(theta)}
    if current.get("partial_rotary_factor") is not None:
        parameters["partial_rotary_factor"] = current["partial_rotary_factor"]
    return parameters


def scaled_length(parameters: dict[str, Any]) -> int | None:
    """Tokens a YaRN parameter dict covers (``factor * original_max_position_embeddings``); ``None`` for others."""
    if parameters.get("rope_type") != "yarn":
        return None
    return math.ceil(float(parameters["factor"]) * int(parameters["original_max_position_embeddings"]) - 1e-6)


def apply_rope_parameters(config: Any, parameters: dict[str, Any]) -> Any:
    """Set ``config.rope_parameters`` to ``parameters`` (a copy) and, for YaRN, ``max_position_embeddings`` to
    the length it covers; returns ``config``. Must happen before the model is built from the config."""
    if not isinstance(parameters, dict) or not parameters.get("rope_type"):
        raise ValueError(f"rope parameters must be a dict with a rope_type, got {parameters!r}")
    if parameters["rope_type"] == "yarn":
        missing = [key for key in ("factor", "original_max_position_embeddings", "rope_theta") if key not in parameters]
        if missing:
            raise ValueError(f"YaRN rope parameters need {', '.join(missing)}: got {parameters!r}")
    config.rope_parameters = copy.deepcopy(parameters)
    covered = scaled_length(parameters)
    if covered is not None:
        config.max_position_embeddings = max(covered, int(parameters["original_max_position_embeddings"]))
    return config


def apply_yarn(config: Any, target_length: int | None = None, *, factor: float | None = None,
               whole: bool = False) -> Any:
    """:func:`apply_rope_parameters` with :func:`yarn_parameters` (same arguments); returns ``config``."""
    return apply_rope_parameters(config, yarn_parameters(config, target_length, factor=factor, whole=whole))


def _model_name(model: Any) -> str:
    """The model's folder or Hub id, or "" when it was built from a config."""
    return str(getattr(getattr(model, "config", None), "_name_or_path", "") or "")


def fix_lines(config: Any, prompt_length: int, name: str = "NAME") -> str:
    """The lines that load the model with YaRN for ``prompt_length`` tokens (the warning's advice)."""
    parameters = yarn_parameters(config, prompt_length, whole=True)
    covered = scaled_length(parameters)
    return (f"    config = AutoConfig.from_pretrained({name!r})\n"
            f"    config.rope_parameters = {json.dumps(parameters)}\n"
            f"    config.max_position_embeddings = {covered}\n"
            f"    model = AutoModelForCausalLM.from_pretrained({name!r}, config=config)\n"
            f"  (or hf_sparse.rope_scaling.apply_yarn(config, {prompt_length}, whole=True) before from_pretrained; "
            f"in the hf-sparse CLI: --rope-scaling yarn:{parameters['factor']:g})")


#: Model -> ids of the configs it has been warned about (a model whose config object is replaced warns again).
_WARNED: "weakref.WeakKeyDictionary[Any, set[int]]" = weakref.WeakKeyDictionary()


def _length_of(prompt: Any) -> int | None:
    if prompt is None:
        return None
    if isinstance(prompt, int):
        return prompt
    shape = getattr(prompt, "shape", None)
    if shape is None or len(shape) == 0:
        raise TypeError(f"prompt_length must be an int or a tensor of token ids / embeddings, got "
                        f"{type(prompt).__name__}")
    return int(shape[1] if len(shape) >= 2 else shape[0])


def check_context_length(model: Any, prompt_length: Any) -> bool:
    """Warn (once per model and config object) when a prompt is longer than the model's
    ``max_position_embeddings`` and the model has no rope scaling; returns whether it warned.

    ``prompt_length``: the number of prompt tokens, or the prompt's ``input_ids`` ``[B, S]`` / ``[S]`` or
    ``inputs_embeds`` ``[B, S, H]`` (``None`` = nothing to check). A model with rope scaling configured is not
    checked: its scaling decides how far it reaches."""
    length = _length_of(prompt_length)
    config = getattr(model, "config", None)
    limit = getattr(config, "max_position_embeddings", None)
    if length is None or not isinstance(limit, int) or length <= limit:
        return False
    try:
        if has_rope_scaling(config):
            return False
        advice = fix_lines(config, length, _model_name(model) or "MODEL")
    except (TypeError, ValueError):  # a nested or missing rope config: nothing we can advise on
        return False
    warned = _WARNED.setdefault(model, set())
    if id(config) in warned:
        return False
    warned.add(id(config))
    logger.warning(
        "%s: the prompt has %d tokens, more than max_position_embeddings %d, and the model has no rope scaling: "
        "positions past %d were never trained and its output degrades into noise. Load it with YaRN rope scaling "
        "(factor = length / %d, rounded up):\n%s", _model_name(model) or type(model).__name__, length, limit, limit,
        limit, advice)
    return True
