"""The recurrent mixers' scans (model/scan.py) against their definition, the per-token recurrence
written here in float64, and against transformers' own math (Qwen3-Next's gated delta rule,
Granite 4.0-H's Mamba2 mixer); split at chunk boundaries they are bit for bit the unsplit call
(the property a prefix-cache hit on a recurrent model rests on); their decode steps continue a
prefill."""

from __future__ import annotations

from typing import Callable

import pytest
import torch
import torch.nn.functional as F

from hicache.model.scan import (
    ScanOut,
    ScanSpan,
    causal_conv,
    chunk_blocks,
    conv_step,
    delta_rule_qk,
    delta_rule_scan,
    delta_rule_step,
    row_sigmoid,
    row_softplus,
    ssd_scan,
    ssd_step,
)

pytestmark = pytest.mark.model

T, H = 300, 4
TOLERANCE = {torch.float64: 1e-6, torch.float32: 1e-4}


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _gdn_inputs(length: int, key_heads: int, dtype: torch.dtype, seed: int = 0) -> dict[str, torch.Tensor]:
    """Raw q, k ``[T, Hk, 16]``, v ``[T, H, 24]``, g (log decays from ~0 to ~-3 a row; ten times
    stronger in the last head, whose weights across a chunk fall below float32's range), beta, a
    nonzero state."""
    gen, dk, dv = _gen(seed), 16, 24
    return {
        "q": torch.randn(length, key_heads, dk, generator=gen, dtype=dtype),
        "k": torch.randn(length, key_heads, dk, generator=gen, dtype=dtype),
        "v": torch.randn(length, H, dv, generator=gen, dtype=dtype),
        "g": -torch.exp(torch.randn(length, H, generator=gen, dtype=dtype) * 1.5 - 2) * torch.tensor([1, 1, 1, 10]),
        "beta": torch.rand(length, H, generator=gen, dtype=dtype),
        "state": torch.randn(H, dk, dv, generator=gen, dtype=dtype) * 0.5,
    }


def _ssd_inputs(length: int, dtype: torch.dtype, seed: int = 0) -> dict[str, torch.Tensor]:
    """x ``[T, H, 8]``, dt, A (seed 0: one head's log decay sums to ~-230 over a chunk), B and C
    of 2 groups of 12, D, a nonzero state."""
    gen, groups, p, n = _gen(seed), 2, 8, 12
    return {
        "x": torch.randn(length, H, p, generator=gen, dtype=dtype),
        "dt": F.softplus(torch.randn(length, H, generator=gen, dtype=dtype) - 1),
        "A": -torch.exp(torch.randn(H, generator=gen, dtype=dtype)),
        "B": torch.randn(length, groups, n, generator=gen, dtype=dtype) * 0.5,
        "C": torch.randn(length, groups, n, generator=gen, dtype=dtype) * 0.5,
        "D": torch.randn(H, generator=gen, dtype=dtype),
        "state": torch.randn(H, p, n, generator=gen, dtype=dtype),
    }


def _conv_inputs(length: int, dtype: torch.dtype, seed: int = 0) -> dict[str, torch.Tensor]:
    gen, channels, taps = _gen(seed), 10, 4
    return {
        "x": torch.randn(length, channels, generator=gen, dtype=dtype),
        "weight": torch.randn(channels, taps, generator=gen, dtype=dtype),
        "bias": torch.randn(channels, generator=gen, dtype=dtype),
        "state": torch.randn(channels, taps - 1, generator=gen, dtype=dtype),
    }


def _delta_reference(q, k, v, g, beta, state):
    """The gated delta rule token by token in float64 (q, k already normalised and q scaled)."""
    q, k, v, g, beta, s = (t.double() for t in (q, k, v, g, beta, state))
    repeat = v.shape[1] // k.shape[1]
    q, k = q.repeat_interleave(repeat, 1), k.repeat_interleave(repeat, 1)
    outs = []
    for t in range(q.shape[0]):
        s = s * g[t].exp()[:, None, None]
        predicted = torch.einsum("hkv,hk->hv", s, k[t])
        s = s + torch.einsum("hk,hv->hkv", k[t], beta[t][:, None] * (v[t] - predicted))
        outs.append(torch.einsum("hkv,hk->hv", s, q[t]))
    return torch.stack(outs), s


def _ssd_reference(x, dt, A, B, C, D, state):
    """Mamba2's SSM token by token in float64."""
    x, dt, A, B, C, D, s = (t.double() for t in (x, dt, A, B, C, D, state))
    repeat = x.shape[1] // B.shape[1]
    B, C = B.repeat_interleave(repeat, 1), C.repeat_interleave(repeat, 1)
    outs = []
    for t in range(x.shape[0]):
        s = s * (dt[t] * A).exp()[:, None, None] + torch.einsum("hp,hn->hpn", dt[t][:, None] * x[t], B[t])
        outs.append(torch.einsum("hpn,hn->hp", s, C[t]) + D[:, None] * x[t])
    return torch.stack(outs), s


def _conv_reference(x, weight, bias, state):
    window = torch.cat([state.double().T, x.double()])
    taps = weight.shape[1]
    y = torch.stack([(window[t:t + taps].T * weight.double()).sum(1) + bias.double() for t in range(x.shape[0])])
    return y, window[-(taps - 1):].T


def _assert_close(got: torch.Tensor, want: torch.Tensor, tolerance: float) -> None:
    """The largest difference relative to the reference's spread."""
    spread = (want.max() - want.min()).item()
    diff = (got.double() - want.double()).abs().max().item()
    assert diff <= tolerance * spread, f"max diff {diff:.3g} is {diff / spread:.3g} of the spread {spread:.3g}"


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("start", [0, 37])
@pytest.mark.parametrize("key_heads", [H, 2])
def test_delta_rule_is_the_token_recurrence(dtype, start, key_heads):
    """T = 300 rows (not a multiple of 64), from position 0 or mid-chunk, shared key heads too."""
    inputs = _gdn_inputs(T, key_heads, dtype)
    q, k = delta_rule_qk(inputs["q"], inputs["k"])
    rows = (q, k, inputs["v"], inputs["g"], inputs["beta"], inputs["state"])
    got = delta_rule_scan(*rows, ScanSpan(start=start))
    want_out, want_state = _delta_reference(*rows)
    assert got.out.dtype == dtype and got.state.dtype == dtype and got.out.shape == want_out.shape
    _assert_close(got.out, want_out, TOLERANCE[dtype])
    _assert_close(got.state, want_state, TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("start", [0, 37])
def test_ssd_is_the_token_recurrence(dtype, start):
    inputs = _ssd_inputs(T, dtype)
    got = ssd_scan(**inputs, span=ScanSpan(start=start))
    want_out, want_state = _ssd_reference(**inputs)
    assert got.out.dtype == dtype and got.state.dtype == dtype and got.out.shape == want_out.shape
    _assert_close(got.out, want_out, TOLERANCE[dtype])
    _assert_close(got.state, want_state, TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_causal_conv_is_the_tap_sum(dtype):
    inputs = _conv_inputs(T, dtype)
    got = causal_conv(**inputs)
    want_out, want_state = _conv_reference(**inputs)
    _assert_close(got.out, want_out, TOLERANCE[dtype])
    assert torch.equal(got.state, inputs["x"][-3:].T)  # the last K-1 inputs, copied exactly


def test_delta_rule_matches_transformers():
    """Qwen3-Next's chunked and per-token delta rules (their L2 norm and scale inside) on raw q, k."""
    from transformers.models.qwen3_next import modeling_qwen3_next as hf

    inputs = _gdn_inputs(T, 2, torch.float32, seed=1)
    q, k = delta_rule_qk(inputs["q"], inputs["k"])
    got = delta_rule_scan(q, k, inputs["v"], inputs["g"], inputs["beta"], inputs["state"])
    raw = [inputs[name][None] for name in ("q", "k", "v", "g", "beta")]
    for reference in (hf.torch_chunk_gated_delta_rule, hf.torch_recurrent_gated_delta_rule):
        out, state = reference(*raw, initial_state=inputs["state"][None], output_final_state=True,
                               use_qk_l2norm_in_kernel=True)
        _assert_close(got.out, out[0], 1e-4)
        _assert_close(got.state, state[0], 1e-4)


def test_ssd_matches_the_granite_mixer():
    """transformers' GraniteMoeHybridMambaLayer (random weights, its own chunk of 256) against
    in_proj -> causal_conv + SiLU -> ssd_scan -> its gated norm -> out_proj on its weights."""
    from transformers import GraniteMoeHybridConfig
    from transformers.models.granitemoehybrid.modeling_granitemoehybrid import GraniteMoeHybridMambaLayer

    config = GraniteMoeHybridConfig(hidden_size=64, num_hidden_layers=1, layer_types=["mamba"], mamba_n_heads=8,
                                    mamba_n_groups=2, mamba_d_state=16, mamba_d_conv=4, mamba_chunk_size=256)
    torch.manual_seed(2)
    layer = GraniteMoeHybridMambaLayer(config, 0).eval()
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
        layer.norm.weight.add_(1.0)
    heads, width, groups, n = 8, layer.head_dim, 2, 16
    hidden = torch.randn(1, T, 64)
    with torch.no_grad():
        want = layer(hidden)[0]
        gate, xbc, dt = layer.in_proj(hidden[0]).split([heads * width, layer.conv_dim, heads], -1)
        zero_conv = torch.zeros(layer.conv_dim, 3)
        xbc = F.silu(causal_conv(xbc, layer.conv1d.weight[:, 0], layer.conv1d.bias, zero_conv).out)
        x, b, c = xbc.split([heads * width, groups * n, groups * n], -1)
        dt = F.softplus(dt + layer.dt_bias).clamp(*config.time_step_limit)
        y = ssd_scan(x.view(T, heads, width), dt, -layer.A_log.exp(), b.view(T, groups, n), c.view(T, groups, n),
                     layer.D, torch.zeros(heads, width, n)).out
        got = layer.out_proj(layer.norm(y.reshape(T, heads * width), gate))
    _assert_close(got, want, 1e-4)


def _gdn_runner() -> tuple[Callable[..., ScanOut], torch.Tensor]:
    inputs = _gdn_inputs(293, 2, torch.float32, seed=3)
    q, k = delta_rule_qk(inputs["q"], inputs["k"])
    rows = (q, k, inputs["v"], inputs["g"], inputs["beta"])

    def run(a: int, b: int, state: torch.Tensor, emit: tuple[int, ...] = ()) -> ScanOut:
        return delta_rule_scan(*(t[a:b] for t in rows), state, ScanSpan(start=a, emit=emit))
    return run, inputs["state"]


def _ssd_runner() -> tuple[Callable[..., ScanOut], torch.Tensor]:
    inputs = _ssd_inputs(293, torch.float32, seed=3)

    def run(a: int, b: int, state: torch.Tensor, emit: tuple[int, ...] = ()) -> ScanOut:
        x, dt, B, C = (inputs[name][a:b] for name in ("x", "dt", "B", "C"))
        return ssd_scan(x, dt, inputs["A"], B, C, inputs["D"], state, ScanSpan(start=a, emit=emit))
    return run, inputs["state"]


def _conv_runner() -> tuple[Callable[..., ScanOut], torch.Tensor]:
    inputs = _conv_inputs(293, torch.float32, seed=3)

    def run(a: int, b: int, state: torch.Tensor, emit: tuple[int, ...] = ()) -> ScanOut:
        return causal_conv(inputs["x"][a:b], inputs["weight"], inputs["bias"], state, ScanSpan(start=a, emit=emit))
    return run, inputs["state"]


def _chained(run: Callable[..., ScanOut], cuts: list[int], state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    outs = []
    for a, b in zip(cuts, cuts[1:]):
        result = run(a, b, state)
        outs.append(result.out)
        state = result.state
    return torch.cat(outs), state


@pytest.mark.parametrize("runner", [_gdn_runner, _ssd_runner, _conv_runner], ids=["gdn", "ssd", "conv"])
@pytest.mark.parametrize("threads", ["one", "machine"])
def test_split_at_chunk_boundaries_is_bitwise_the_whole_call(runner, threads, request):
    """[0, 293) in one call equals [0, 128) + [128, 293) and [0, 64) + [64, 192) + [192, 293),
    outputs and end state; the states it emits at 64 / 128 / 192 are the end states of calls
    stopping there; a call from 37 (mid-chunk) equals [37, 64) + [64, 293)."""
    if threads == "machine":
        request.getfixturevalue("machine_threads")
    run, state = runner()
    whole = run(0, 293, state, emit=(64, 128, 192))
    for cuts in ([0, 128, 293], [0, 64, 192, 293]):
        out, end = _chained(run, cuts, state)
        assert torch.equal(out, whole.out) and torch.equal(end, whole.state), cuts
    for position, emitted in zip((64, 128, 192), whole.emitted):
        assert torch.equal(emitted, run(0, position, state).state), position
    from_mid = run(37, 293, state)
    out, end = _chained(run, [37, 64, 293], state)
    assert torch.equal(out, from_mid.out) and torch.equal(end, from_mid.state)


def test_emit_off_the_grid_is_refused():
    run, state = _gdn_runner()
    for emit in ((100,), (320,)):
        with pytest.raises(ValueError, match=f"cannot emit the state at position {emit[0]}"):
            run(0, 293, state, emit=emit)
    assert chunk_blocks(37, 100, 64) == [(0, 27), (27, 91), (91, 100)]


def test_delta_rule_steps_continue_a_prefill():
    """Two sequences prefilled (200 and 137 rows) then stepped together for 20 tokens equal each
    one's scan over the longer sequence."""
    lengths, steps = (200, 137), 20
    seqs = [_gdn_inputs(n + steps, 2, torch.float32, seed=4 + i) for i, n in enumerate(lengths)]
    normed = [delta_rule_qk(s["q"], s["k"]) for s in seqs]
    rows = [(q, k, s["v"], s["g"], s["beta"]) for (q, k), s in zip(normed, seqs)]
    whole = [delta_rule_scan(*r, s["state"]) for r, s in zip(rows, seqs)]
    states = torch.stack([delta_rule_scan(*(t[:n] for t in r), s["state"]).state
                          for r, s, n in zip(rows, seqs, lengths)])
    for i in range(steps):
        step_rows = [torch.stack([r[j][n + i] for r, n in zip(rows, lengths)]) for j in range(5)]
        out, states = delta_rule_step(*step_rows, states)
        for b, (result, n) in enumerate(zip(whole, lengths)):
            _assert_close(out[b], result.out[n + i], 1e-4)
    for b in range(2):
        _assert_close(states[b], whole[b].state, 1e-4)


def test_ssd_steps_continue_a_prefill():
    lengths, steps = (200, 137), 20
    seqs = [_ssd_inputs(n + steps, torch.float32, seed=4 + i) for i, n in enumerate(lengths)]
    shared = {"A": seqs[0]["A"], "D": seqs[0]["D"]}
    names = ("x", "dt", "B", "C")
    whole = [ssd_scan(**{m: s[m] for m in names}, **shared, state=s["state"]) for s in seqs]
    states = torch.stack([ssd_scan(**{m: s[m][:n] for m in names}, **shared, state=s["state"]).state
                          for s, n in zip(seqs, lengths)])
    for i in range(steps):
        x, dt, B, C = (torch.stack([s[m][n + i] for s, n in zip(seqs, lengths)]) for m in names)
        out, states = ssd_step(x, dt, shared["A"], B, C, shared["D"], states)
        for b, (result, n) in enumerate(zip(whole, lengths)):
            _assert_close(out[b], result.out[n + i], 1e-4)
    for b in range(2):
        _assert_close(states[b], whole[b].state, 1e-4)


def test_conv_steps_continue_a_prefill_bitwise():
    """The conv step's taps are the scan's, in the same order: equal bit for bit."""
    lengths, steps = (200, 2), 20  # a prefill shorter than the K-1 = 3 taps of state too
    seqs = [_conv_inputs(n + steps, torch.float32, seed=4 + i) for i, n in enumerate(lengths)]
    weight, bias = seqs[0]["weight"], seqs[0]["bias"]
    whole = [causal_conv(s["x"], weight, bias, s["state"]) for s in seqs]
    states = torch.stack([causal_conv(s["x"][:n], weight, bias, s["state"]).state for s, n in zip(seqs, lengths)])
    for i in range(steps):
        out, states = conv_step(torch.stack([s["x"][n + i] for s, n in zip(seqs, lengths)]), weight, bias, states)
        assert all(torch.equal(out[b], whole[b].out[n + i]) for b, n in enumerate(lengths))
    assert all(torch.equal(states[b], whole[b].state) for b in range(2))


@pytest.mark.parametrize("fn, reference", [(row_sigmoid, torch.sigmoid), (row_softplus, F.softplus)])
def test_a_rows_gates_do_not_depend_on_the_rows_beside_it(fn: Callable, reference: Callable) -> None:
    """The recurrent layers' [T, heads] gates: a row gives the same bits alone as in a batch of any size
    (deterministic inference batches rows; torch's own CPU sigmoid and softplus round a vector's tail
    differently), within float32 rounding of torch's function."""
    torch.manual_seed(0)
    rows = torch.randn(23, 4) * 6
    alone = torch.cat([fn(rows[i:i + 1]) for i in range(len(rows))])
    for n in range(2, len(rows) + 1):
        assert torch.equal(fn(rows[:n]), alone[:n])
    torch.testing.assert_close(alone, reference(rows), rtol=1e-6, atol=1e-6)
