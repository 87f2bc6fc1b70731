"""A generate() prefill's feed-forward blocks hold fewer activations (hf_sparse.feed_forward)."""
import copy
import functools

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForCausalLM, MixtralConfig

import hf_sparse
from hf_sparse.feed_forward import direct_forward, feed_forward_blocks, gated, lean_forward, swap_in, swap_out

from conftest import build, tiny_config


def _generate(model, make, prompt, mask, chunk, rows):
    hf_sparse.configure(model, make(block_size=16, dense_below=32, prefill_mlp_chunk=chunk))
    rows.clear()
    return model.generate(prompt, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0,
                          return_dict_in_generate=True, output_logits=True)


@pytest.mark.parametrize("method", ["plas", "xattn", "star"])
@pytest.mark.parametrize("act", ["silu", "gelu_pytorch_tanh"])
def test_prefill_feed_forward_holds_fewer_activations_with_the_same_outputs(method, act):
    """In a prefill a SiLU-gated MLP runs over the whole input with its gate in place (the activation module is not
    called; logits bit-equal to its own forward's), also under ``dense_below`` (where the logits stay bit-equal to
    sdpa's); a GELU-gated one (or a SiLU one whose gate projection a hook watches) takes its gate and up projections
    over slices of at most ``prefill_mlp_chunk`` tokens (batch x positions) and its down projection over the whole
    input (the tokens and logits of whole-input MLPs). Every decode step runs each MLP's own forward; nothing stays
    swapped or hooked after."""
    config = tiny_config("llama", layers=3)
    config.hidden_act = act
    model = build(config, "sdpa")
    make = {"plas": hf_sparse.PLASConfig, "xattn": hf_sparse.XAttnConfig, "star": hf_sparse.StarConfig}[method]
    rows, down, activations = [], [], []
    for layer in model.model.layers:
        layer.mlp.up_proj.register_forward_hook(lambda module, args, output: rows.append(args[0].shape[:2]))
        layer.mlp.down_proj.register_forward_hook(lambda module, args, output: down.append(args[0].shape[:2]))
        layer.mlp.act_fn.register_forward_hook(lambda module, args, output: activations.append(args[0].shape[:2]))
    ids = torch.randint(1, 128, (2, 80), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    ids[1, :5], mask[1, :5] = 0, 0  # a left-padded row
    layers = len(model.model.layers)
    with torch.no_grad():
        whole = _generate(model, make, ids, mask, None, rows)
        assert rows[:layers] == [(2, 80)] * layers
        down.clear()
        activations.clear()
        lean = _generate(model, make, ids, mask, 48, rows)  # 48 tokens over a batch of 2: 24 positions a slice
        assert down[:layers] == [(2, 80)] * layers
        if act == "silu":
            prefill = layers
            assert rows[:prefill] == [(2, 80)] * layers and activations[:1] == [(2, 1)]
            assert torch.equal(whole.sequences, lean.sequences)
            assert all(torch.equal(a, b) for a, b in zip(whole.logits, lean.logits))
        else:
            prefill = layers * 4
            assert rows[:prefill] == [(2, 24), (2, 24), (2, 24), (2, 8)] * layers
            assert torch.equal(whole.sequences, lean.sequences)
            for a, b in zip(whole.logits, lean.logits):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        assert rows[prefill:] == [(2, 1)] * (len(rows) - prefill) and len(rows) > prefill
        if act == "silu":  # in place whatever the slice size
            activations.clear()
            assert torch.equal(_generate(model, make, ids, mask, 10**6, rows).sequences, whole.sequences)
            assert rows[:layers] == [(2, 80)] * layers and activations[:1] == [(2, 1)]
        own = _generate(model, make, ids[:, :30], mask[:, :30], None, rows)  # under dense_below: dense
        activations.clear()
        short = _generate(model, make, ids[:, :30], mask[:, :30], 10**6, rows)
        assert rows[:layers] == [(2, 30)] * layers
        assert activations[:1] == ([(2, 1)] if act == "silu" else [(2, 30)])
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
            torch.testing.assert_close(lean_forward(block, 10, x), block(x), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(lean_forward(block, 10, x), block(x), rtol=1e-6, atol=1e-6)  # with gradients


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
    """The SiLU-gated path runs the ops of the block's own forward, in the same order and shapes, but for the
    activation and the product, which write into the gate projection's output (silu_, mul_): two fewer
    ``[tokens, intermediate_size]`` tensors, the same values."""
    from transformers.models.llama.modeling_llama import LlamaMLP

    block = LlamaMLP(tiny_config("llama", q_heads=2)).eval()
    x = torch.randn(1, 100, 32)
    with torch.no_grad():
        with _Ops() as own:
            expected = block(x)
        with _Ops() as lean:
            got = lean_forward(block, 16, x)
    in_place = {"silu": "silu_", "mul": "mul_"}
    assert lean.ops == [(in_place.get(name, name), shape) for name, shape in own.ops]
    assert ("silu", (1, 100, 64)) in own.ops and ("mul", (1, 100, 64)) in own.ops
    assert torch.equal(got, expected)
    seen = []
    block.gate_proj.register_forward_hook(lambda module, args, output: seen.append(output))
    with torch.no_grad():
        with _Ops() as hooked:
            got = lean_forward(block, 16, x)
    assert ("silu_", (1, 100, 64)) not in hooked.ops and len(seen) == 7  # sliced: the hook's outputs untouched
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(torch.cat(seen, dim=1), block.gate_proj(x), rtol=1e-6, atol=1e-6)


def test_plain_projections_run_as_functions_with_the_same_ops_and_values(monkeypatch):
    """Swapped in, a SiLU-gated MLP whose projections are plain ``nn.Linear`` modules runs their weights through
    ``F.linear``: lean_forward's ops and values, and no module call. A hook on a projection, gradients, or a
    projection of another class or with a forward of its own take lean_forward's path, which calls the modules;
    swap_out restores the block, and the next swap_in takes the forward it made while the block's parts stay."""
    model = build(tiny_config("llama", layers=2), "sdpa")
    block = model.model.layers[0].mlp
    hidden, intermediate = block.gate_proj.in_features, block.gate_proj.out_features
    x = torch.randn(2, 37, hidden)
    calls = []
    linear_forward = torch.nn.Linear.forward
    monkeypatch.setattr(torch.nn.Linear, "forward", lambda self, x: calls.append(self) or linear_forward(self, x))
    with torch.no_grad():
        expected = block(x)
        with _Ops() as lean:
            assert torch.equal(lean_forward(block, 16, x), expected)
        blocks = swap_in(model, 16)
        assert block.forward.func is direct_forward
        calls.clear()
        with _Ops() as direct:
            assert torch.equal(block(x), expected)
        assert calls == [] and direct.ops == lean.ops
        seen = []
        handle = block.down_proj.register_forward_hook(lambda module, args, output: seen.append(output.shape))
        assert torch.equal(block(x), expected)
        assert seen == [(2, 37, hidden)] and len(calls) == 3
        handle.remove()
    calls.clear()
    torch.testing.assert_close(block(x), expected, rtol=1e-6, atol=1e-6)  # with gradients: lean_forward's slices,
    assert len(calls) == 5 * 3  # 5 of at most 8 positions (16 tokens over a batch of 2), 3 projections each
    made = block.forward
    swap_out(blocks)
    assert "forward" not in block.__dict__
    assert swap_in(model, 16) == blocks and block.forward is made  # kept for the next prefill
    swap_out(blocks)
    block.up_proj.forward = functools.partial(torch.nn.Linear.forward, block.up_proj)  # (another library's hook)
    swap_in(model, 16)
    assert block.forward.func is lean_forward
    swap_out(blocks)
    del block.up_proj.forward

    class Adapted(torch.nn.Linear):
        pass

    adapted = Adapted(hidden, intermediate, bias=False)
    adapted.load_state_dict(block.up_proj.state_dict())
    block.up_proj = adapted
    swap_in(model, 16)
    assert block.forward.func is lean_forward and model.model.layers[1].mlp.forward.func is direct_forward
    with torch.no_grad():
        assert torch.equal(block(x), expected)
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
    out = lean_forward(block, 4, x)
    assert torch.equal(out[0], x) and Pair.calls == 2  # the first slice's tuple, then the whole input
    out = lean_forward(block, 4, x, scale=2.0)
    assert torch.equal(out[0], 2 * x) and Pair.calls == 3
    linear = torch.nn.Linear(4, 3)
    torch.testing.assert_close(lean_forward(linear, 3, x), linear(x), rtol=0, atol=1e-6)


@pytest.mark.parametrize("value", [0, -4, 2.5, "8", True])
def test_prefill_mlp_chunk_is_checked(value):
    with pytest.raises(ValueError, match="prefill_mlp_chunk"):
        hf_sparse.PLASConfig(prefill_mlp_chunk=value)
