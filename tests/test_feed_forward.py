"""A generate() prefill's feed-forward blocks hold fewer activations (hf_sparse.feed_forward)."""
import copy
import functools

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForCausalLM, MixtralConfig

import hf_sparse
from hf_sparse import feed_forward
from hf_sparse.feed_forward import (Slices, direct_forward, feed_forward_blocks, gated, lean_forward, slices_for,
                                     swap_in, swap_out)

from conftest import build, tiny_config


def _generate(model, make, prompt, mask, seen, **fields):
    hf_sparse.configure(model, make(block_size=16, dense_below=32, **fields))
    for shapes in seen.values():
        shapes.clear()
    return model.generate(prompt, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0,
                          return_dict_in_generate=True, output_logits=True)


def _watch_projections(model, monkeypatch):
    """The leading shapes of the inputs each layer's up and down projections get through ``F.linear`` (the call
    both ``nn.Linear`` and the swapped-in MLPs make), and of the activation module's through its class's forward:
    recorded without a hook (a hook on a block's child makes the block run its own forward)."""
    seen = {"up": [], "down": [], "act": []}
    names = {}
    for layer in model.model.layers:
        names[id(layer.mlp.up_proj.weight)], names[id(layer.mlp.down_proj.weight)] = "up", "down"
    activation = type(model.model.layers[0].mlp.act_fn)
    act_forward = activation.forward
    monkeypatch.setattr(activation, "forward", lambda self, x: seen["act"].append(x.shape[:-1]) or act_forward(self, x))
    linear = torch.nn.functional.linear

    def recorded(x, weight, bias=None):
        if id(weight) in names:
            seen[names[id(weight)]].append(x.shape[:-1])
        return linear(x, weight, bias)

    monkeypatch.setattr(torch.nn.functional, "linear", recorded)
    return seen


@pytest.mark.parametrize("method", ["plas", "xattn", "star"])
@pytest.mark.parametrize("act", ["silu", "gelu_pytorch_tanh"])
def test_prefill_feed_forward_holds_fewer_activations_with_the_same_outputs(method, act, monkeypatch):
    """In a prefill a SiLU-gated MLP runs with its gate in place (the activation module is not called): over slices
    of at most ``prefill_silu_rows`` rows of its ``[tokens, hidden]`` view where the prefill has more tokens (the
    tokens and logits of whole-input MLPs), over the whole input otherwise, with ``"auto"`` and a cache of the
    model's dtype, and where a hook watches a projection (logits bit-equal to its own forward's), also under
    ``dense_below`` (where the logits stay bit-equal to sdpa's); a GELU-gated one takes its gate and up projections
    over slices of at most ``prefill_mlp_chunk`` tokens (batch x positions) and its down projection over the whole
    input (the tokens and logits of whole-input MLPs). Every decode step runs each MLP's own forward; nothing stays
    swapped or hooked after."""
    config = tiny_config("llama", layers=3)
    config.hidden_act = act
    model = build(config, "sdpa")
    make = {"plas": hf_sparse.PLASConfig, "xattn": hf_sparse.XAttnConfig, "star": hf_sparse.StarConfig}[method]
    seen = _watch_projections(model, monkeypatch)
    ids = torch.randint(1, 128, (2, 80), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    ids[1, :5], mask[1, :5] = 0, 0  # a left-padded row
    layers = len(model.model.layers)
    with torch.no_grad():
        whole = _generate(model, make, ids, mask, seen, prefill_mlp_chunk=None)
        assert seen["up"][:layers] == [(2, 80)] * layers
        if act == "silu":  # 160 rows: slices of 48
            lean = _generate(model, make, ids, mask, seen, prefill_silu_rows=48)
            prefill = layers * 4
            assert seen["up"][:prefill] == seen["down"][:prefill] == [(48,), (48,), (48,), (16,)] * layers
        else:  # 48 tokens over a batch of 2: 24 positions a slice
            lean = _generate(model, make, ids, mask, seen, prefill_mlp_chunk=48)
            prefill = layers * 4
            assert seen["up"][:prefill] == [(2, 24), (2, 24), (2, 24), (2, 8)] * layers
            assert seen["down"][:layers] == [(2, 80)] * layers
        assert seen["act"][:1] == ([(2, 1)] if act == "silu" else [(2, 24)])
        assert torch.equal(whole.sequences, lean.sequences)
        for a, b in zip(whole.logits, lean.logits):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        assert seen["up"][prefill:] == [(2, 1)] * (len(seen["up"]) - prefill) and len(seen["up"]) > prefill
        if act == "silu":  # at most prefill_silu_rows tokens, "auto" with this cache, or a hooked projection: whole
            for fields, hook in (({"prefill_silu_rows": 160}, False), ({}, False), ({"prefill_silu_rows": 48}, True)):
                handles = [layer.mlp.down_proj.register_forward_hook(lambda module, args, output: None)
                           for layer in model.model.layers if hook]
                kept = _generate(model, make, ids, mask, seen, **fields)
                for handle in handles:
                    handle.remove()
                assert seen["up"][:layers] == [(2, 80)] * layers
                assert seen["act"][:1] == ([(2, 80)] if hook else [(2, 1)])  # hooked: the block's own forward
                assert torch.equal(kept.sequences, whole.sequences)
                assert all(torch.equal(a, b) for a, b in zip(whole.logits, kept.logits))
        own = _generate(model, make, ids[:, :30], mask[:, :30], seen, prefill_mlp_chunk=None)  # under dense_below
        short = _generate(model, make, ids[:, :30], mask[:, :30], seen, prefill_mlp_chunk=10**6)
        assert seen["up"][:layers] == [(2, 30)] * layers
        assert seen["act"][:1] == ([(2, 1)] if act == "silu" else [(2, 30)])
        assert all(torch.equal(a, b) for a, b in zip(short.logits, own.logits))
        model.config._attn_implementation = "sdpa"
        dense = model.generate(ids[:, :30], attention_mask=mask[:, :30], max_new_tokens=1, do_sample=False,
                               pad_token_id=0, return_dict_in_generate=True, output_logits=True)
        model.config._attn_implementation = method
        assert torch.equal(short.logits[0], dense.logits[0])  # the prefill's logits: sdpa's bit for bit
    assert not model._forward_pre_hooks and not model._forward_hooks
    assert all("forward" not in layer.mlp.__dict__ for layer in model.model.layers)


def test_feed_forward_blocks_leave_experts_and_foreign_forwards_alone():
    """A mixture of experts' block, and a block whose forward another library replaced, are not taken; the walk
    kept for the next call sees a block replaced since."""
    moe = AutoModelForCausalLM.from_config(MixtralConfig(
        vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=256))
    assert feed_forward_blocks(moe) == []
    model = build(tiny_config("llama", layers=2), "sdpa")
    assert feed_forward_blocks(model) == [layer.mlp for layer in model.model.layers]
    model.model.layers[0].mlp.forward = lambda x: x
    assert feed_forward_blocks(model) == [model.model.layers[1].mlp]
    replaced = copy.deepcopy(model.model.layers[1].mlp)  # a block put in place of a found one is found
    model.model.layers[1].mlp = replaced
    assert feed_forward_blocks(model) == [replaced]


def test_gated_mlps_are_told_by_their_forward_code():
    """transformers' gated MLPs (Llama, Qwen2, Mistral) take the gated path; another forward (GPT-2's, Phi-3's
    fused gate and up, the same product returned without its name), and a call that records gradients, the
    slice-and-copy path; both give the whole input's outputs."""
    from transformers import GPT2Config
    from transformers.models.gpt2.modeling_gpt2 import GPT2MLP
    from transformers.models.llama.modeling_llama import LlamaMLP
    from transformers.models.mistral.modeling_mistral import MistralMLP
    from transformers.models.phi3.modeling_phi3 import Phi3MLP
    from transformers.models.qwen2.modeling_qwen2 import Qwen2MLP

    class Renamed(LlamaMLP):
        def forward(self, x):
            return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))

    assert gated(LlamaMLP) and gated(Qwen2MLP) and gated(MistralMLP)
    assert not gated(GPT2MLP) and not gated(Phi3MLP) and not gated(Renamed)
    torch.manual_seed(0)
    x = torch.randn(2, 13, 32)
    for block in (LlamaMLP(tiny_config("llama", q_heads=2)), Renamed(tiny_config("llama", q_heads=2)),
                  GPT2MLP(64, GPT2Config(n_embd=32)).eval()):
        with torch.no_grad():
            torch.testing.assert_close(lean_forward(block, Slices(10, 10), x), block(x), rtol=1e-6, atol=1e-6)
        with torch.enable_grad():  # with gradients
            torch.testing.assert_close(lean_forward(block, Slices(10, 10), x), block(x), rtol=1e-6, atol=1e-6)


class _Ops(TorchDispatchMode):
    """Records each aten op a block runs, with its output's shape."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops.append((func.overloadpacket.__name__, tuple(out.shape) if isinstance(out, torch.Tensor) else None))
        return out


def test_a_silu_gated_mlp_runs_its_own_ops_with_the_gate_in_place():
    """On at most ``chunk_tokens`` tokens the SiLU-gated path runs the ops of the block's own forward, in the same
    order and shapes, but for the activation and the product, which write into the gate projection's output (silu_,
    mul_): two fewer ``[tokens, intermediate_size]`` tensors, the same values. On more it runs them over slices of
    that many rows of the ``[tokens, hidden]`` view (no copy of the input), each slice's output copied into one
    output: the same values to rounding. A hook on a child, a child's forward of its own or a global hook leave the
    block its own forward, whole; a 2-D input runs in place too."""
    from transformers.models.llama.modeling_llama import LlamaMLP

    block = LlamaMLP(tiny_config("llama", q_heads=2)).eval()
    x = torch.randn(1, 100, 32)
    with torch.no_grad():
        with _Ops() as own:
            expected = block(x)
        with _Ops() as lean:
            got = lean_forward(block, Slices(100, 100), x)
        with _Ops() as sliced:
            got_sliced = lean_forward(block, Slices(16, 16), x)
    in_place = {"silu": "silu_", "mul": "mul_"}
    assert lean.ops == [(in_place.get(name, name), shape) for name, shape in own.ops]
    assert ("silu", (1, 100, 64)) in own.ops and ("mul", (1, 100, 64)) in own.ops
    assert torch.equal(got, expected)
    slices = [16] * 6 + [4]
    assert [shape for name, shape in sliced.ops if name == "silu_"] == [(rows, 64) for rows in slices]
    assert [shape for name, shape in sliced.ops if name == "copy_"] == [(rows, 32) for rows in slices]
    assert not any(name in ("clone", "contiguous") or shape == (100, 64) for name, shape in sliced.ops)
    assert got_sliced.shape == expected.shape
    torch.testing.assert_close(got_sliced, expected, rtol=1e-6, atol=1e-6)
    seen = []
    block.gate_proj.register_forward_hook(lambda module, args, output: seen.append(output))
    with torch.no_grad():
        with _Ops() as hooked:
            got = lean_forward(block, Slices(16, 16), x)
        assert hooked.ops == own.ops and len(seen) == 1  # hooked: its own forward, the hook's output untouched
        assert torch.equal(got, expected) and torch.equal(seen[0], block.gate_proj(x))
    block.gate_proj._forward_hooks.clear()
    watchers = [lambda: setattr(block.up_proj, "forward", functools.partial(torch.nn.Linear.forward, block.up_proj)),
                lambda: block.act_fn.register_forward_pre_hook(lambda module, args: None),
                lambda: torch.nn.modules.module.register_module_forward_hook(lambda module, args, output: None)]
    for watch in watchers:  # a forward of its own, a pre-hook on the activation, a global hook: its own forward
        handle = watch()
        with torch.no_grad():
            with _Ops() as watched:
                got = lean_forward(block, Slices(16, 16), x)
        if handle is None:
            del block.up_proj.forward
        else:
            handle.remove()
        assert watched.ops == own.ops and torch.equal(got, expected)
    flat = x.reshape(100, 32)  # another rank: in place too
    with torch.no_grad():
        with _Ops() as two_d:
            got = lean_forward(block, Slices(100, 100), flat)
        assert ("silu_", (100, 64)) in two_d.ops and ("silu", (100, 64)) not in two_d.ops
        assert torch.equal(got, block(flat))


def test_plain_projections_run_as_functions_with_the_same_ops_and_values(monkeypatch):
    """Swapped in, a SiLU-gated MLP whose projections are plain ``nn.Linear`` modules runs their weights through
    ``F.linear``: lean_forward's ops and values (whole or over row slices), and no module call. A hook on a
    projection, gradients, or a projection of another class or with a forward of its own take lean_forward's path,
    which calls the modules (a hook sees the whole input); swap_out restores the block, and the next swap_in takes
    the forward it made while the block's parts stay."""
    model = build(tiny_config("llama", layers=2), "sdpa")
    block = model.model.layers[0].mlp
    hidden, intermediate = block.gate_proj.in_features, block.gate_proj.out_features
    x = torch.randn(2, 37, hidden)
    calls = []
    linear_forward = torch.nn.Linear.forward
    monkeypatch.setattr(torch.nn.Linear, "forward", lambda self, x: calls.append(self) or linear_forward(self, x))
    with torch.no_grad():
        expected = block(x)
        with _Ops() as whole_lean:
            assert torch.equal(lean_forward(block, Slices(74, 74), x), expected)  # 74 tokens: whole
        with _Ops() as lean:
            sliced = lean_forward(block, Slices(16, 16), x)  # slices of 16 rows
        torch.testing.assert_close(sliced, expected, rtol=1e-6, atol=1e-6)
        blocks = swap_in(model, Slices(74, 74))
        calls.clear()
        with _Ops() as direct:
            assert torch.equal(block(x), expected)
        assert calls == [] and direct.ops == whole_lean.ops
        swap_out(blocks)
        blocks = swap_in(model, Slices(16, 16))
        assert block.forward.func is direct_forward
        with _Ops() as direct:
            got = block(x)
        assert torch.equal(got, sliced) and calls == [] and direct.ops == lean.ops
        seen = []
        handle = block.down_proj.register_forward_hook(lambda module, args, output: seen.append(output.shape))
        assert torch.equal(block(x), expected)  # a watched projection: the whole input, in place
        assert seen == [(2, 37, hidden)] and len(calls) == 3
        handle.remove()
    calls.clear()
    torch.testing.assert_close(block(x), expected, rtol=1e-6, atol=1e-6)  # with gradients: lean_forward's slices,
    assert len(calls) == 5 * 3  # 5 of at most 8 positions (16 tokens over a batch of 2), 3 projections each
    made = block.forward
    swap_out(blocks)
    assert "forward" not in block.__dict__
    assert swap_in(model, Slices(16, 16)) == blocks and block.forward is made  # kept for the next prefill
    swap_out(blocks)
    block.up_proj.forward = functools.partial(torch.nn.Linear.forward, block.up_proj)  # (another library's hook)
    swap_in(model, Slices(16, 16))
    assert block.forward.func is lean_forward
    swap_out(blocks)
    del block.up_proj.forward

    class Adapted(torch.nn.Linear):
        pass

    adapted = Adapted(hidden, intermediate, bias=False)
    adapted.load_state_dict(block.up_proj.state_dict())
    block.up_proj = adapted
    swap_in(model, Slices(16, 16))
    assert block.forward.func is lean_forward and model.model.layers[1].mlp.forward.func is direct_forward
    with torch.no_grad():
        assert torch.equal(block(x), sliced)  # lean_forward: the same slices
    swap_out(blocks)


def test_lean_forward_runs_whole_inputs_it_cannot_slice():
    """Outputs that are not ``[batch, positions, ...]`` tensors, and other arguments, run the whole input once."""
    class Pair(torch.nn.Module):
        calls = 0

        def forward(self, x, scale=1.0):
            Pair.calls += 1
            return x * scale, x.sum()

    x = torch.randn(1, 10, 4)
    block = Pair()
    out = lean_forward(block, Slices(4, 4), x)
    assert torch.equal(out[0], x) and Pair.calls == 2  # the first slice's tuple, then the whole input
    out = lean_forward(block, Slices(4, 4), x, scale=2.0)
    assert torch.equal(out[0], 2 * x) and Pair.calls == 3
    linear = torch.nn.Linear(4, 3)
    torch.testing.assert_close(lean_forward(linear, Slices(3, 3), x), linear(x), rtol=0, atol=1e-6)


@pytest.mark.parametrize("value", [0, -4, 2.5, "8", "auto", True])
def test_prefill_mlp_chunk_is_checked(value):
    with pytest.raises(ValueError, match="prefill_mlp_chunk"):
        hf_sparse.PLASConfig(prefill_mlp_chunk=value)


@pytest.mark.parametrize("make", [hf_sparse.PLASConfig, hf_sparse.XAttnConfig, hf_sparse.StarConfig])
@pytest.mark.parametrize("value", [0, -4, 2.5, "8", "Auto", "auto ", True, torch.tensor(8)])
def test_prefill_silu_rows_is_checked(make, value):
    with pytest.raises(ValueError, match="prefill_silu_rows must be 'auto', None or an int >= 1"):
        make(prefill_silu_rows=value)


def test_slices_need_positive_sizes():
    with pytest.raises(ValueError, match="silu_rows None or >= 1 and tokens >= 1"):
        Slices(0, 16)
    with pytest.raises(ValueError, match="silu_rows None or >= 1 and tokens >= 1"):
        Slices(None, 0)


def test_auto_slices_a_silu_mlp_with_an_int8_cache_only(monkeypatch):
    """``prefill_silu_rows="auto"`` (every method's default) slices a SiLU-gated MLP's rows with an int8 K/V cache
    and runs it whole otherwise (Star's cache is of the model's dtype); an int slices, None runs whole;
    ``prefill_mlp_chunk`` sets the other blocks' tokens, and None there runs transformers' own forwards. A config
    stored by a version without the field keeps the whole MLP it ran with. In generate(): with the auto rows set to
    48, the int8 prefill's MLPs run over 48-row slices and the bf16 one's whole; the int8 prefill's tokens and logits
    equal its whole-MLP run's."""
    rows = feed_forward.AUTO_INT8_SILU_ROWS
    assert slices_for(hf_sparse.PLASConfig(kv_cache_dtype="int8")) == Slices(rows, 16384)
    assert slices_for(hf_sparse.XAttnConfig(kv_cache_dtype="int8", prefill_mlp_chunk=4096)) == Slices(rows, 4096)
    assert slices_for(hf_sparse.PLASConfig()) == slices_for(hf_sparse.StarConfig()) == Slices(None, 16384)
    assert slices_for(hf_sparse.PLASConfig(prefill_silu_rows=48)) == Slices(48, 16384)
    assert slices_for(hf_sparse.PLASConfig(kv_cache_dtype="int8", prefill_silu_rows=None)) == Slices(None, 16384)
    assert slices_for(hf_sparse.PLASConfig(kv_cache_dtype="int8", prefill_mlp_chunk=None)) is None
    for make in (hf_sparse.PLASConfig, hf_sparse.XAttnConfig):
        stored = make(kv_cache_dtype="int8").to_dict()
        del stored["prefill_silu_rows"]
        assert make.from_dict(stored).prefill_silu_rows is None
    monkeypatch.setattr(feed_forward, "AUTO_INT8_SILU_ROWS", 48)
    model = build(tiny_config("llama", layers=2), "plas")
    seen = _watch_projections(model, monkeypatch)
    ids = torch.randint(1, 128, (1, 100), generator=torch.Generator().manual_seed(1))
    runs = {}
    for dtype, silu_rows in (("int8", "auto"), ("int8", None), ("auto", "auto")):
        with torch.no_grad():
            runs[dtype, silu_rows] = _generate(model, hf_sparse.PLASConfig, ids, torch.ones_like(ids), seen,
                                               kv_cache_dtype=dtype, prefill_silu_rows=silu_rows)
        prefill = [(48,), (48,), (4,)] * 2 if (dtype, silu_rows) == ("int8", "auto") else [(1, 100)] * 2
        assert seen["up"] == prefill + [(1, 1)] * 3 * 2  # then three decode steps of two layers
    sliced, whole = runs["int8", "auto"], runs["int8", None]
    assert torch.equal(sliced.sequences, whole.sequences)
    for a, b in zip(sliced.logits, whole.logits):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_row_slices_of_a_strided_input_give_the_whole_inputs_output():
    """A SiLU-gated MLP over row slices takes a non-contiguous input (a view with a stride over positions): its
    output has the input's leading shape and the values of the block's own forward."""
    from transformers.models.llama.modeling_llama import LlamaMLP

    block = LlamaMLP(tiny_config("llama", q_heads=2)).eval()
    x = torch.randn(3, 50, 32)[:, ::2]
    assert not x.is_contiguous()
    with torch.no_grad():
        with _Ops() as ops:
            got = lean_forward(block, Slices(16, 16), x)
        expected = block(x)
    assert [shape for name, shape in ops.ops if name == "silu_"] == [(16, 64)] * 4 + [(11, 64)]  # 75 rows
    assert got.shape == expected.shape == (3, 25, 32)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("batch", [1, 4])
def test_silu_mlp_over_row_slices_equals_the_whole_on_the_gpu(batch):
    """On the GPU in bf16 the swapped-in SiLU MLP of SmolLM2's shape (576 -> 1536) over slices of 8192 rows of 20,000
    tokens (the last slice odd) gives the whole input's output (cuBLAS promises no bit-equality across row counts: to
    bf16 rounding), and peaks at less memory than the whole MLP."""
    torch.manual_seed(0)
    config = tiny_config("llama", layers=1)
    config.hidden_size, config.intermediate_size = 576, 1536
    model = build(config, "sdpa").cuda().to(torch.bfloat16)
    block = model.model.layers[0].mlp
    x = torch.randn(batch, 20000 // batch, 576, device="cuda", dtype=torch.bfloat16)
    peaks = {}
    with torch.no_grad():
        for chunk in (10**6, 8192):
            blocks = swap_in(model, Slices(chunk, chunk))
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            out = block(x)
            torch.cuda.synchronize()
            peaks[chunk] = torch.cuda.max_memory_allocated() - base
            swap_out(blocks)
            if chunk == 10**6:
                whole = out
            del out
        blocks = swap_in(model, Slices(8192, 8192))
        sliced = block(x)
        swap_out(blocks)
    torch.testing.assert_close(sliced, whole, rtol=1.6e-2, atol=1e-2)
    assert peaks[8192] < peaks[10**6]
