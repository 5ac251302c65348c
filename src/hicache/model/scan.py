"""Pure functions of the recurrent layers' sequence math, one state in, one state out.

Units: time-major rows (``[tokens, channels]``); a state is what a layer keeps of a sequence
between passes. Each function's result for a token depends only on the state before the pass and
the tokens up to it, computed the same way whatever the pass holds -- so a prompt run in one
pass, in chunks split anywhere, or token by token (decode) gives the same bits.

Short convolution (LFM2): a depthwise causal convolution of ``K`` taps; its state is the last
``K - 1`` inputs. Output row t of a pass is ``sum_j weight[:, j] * window[t + j]`` over
``window = [state; inputs]``, the taps added one after the other in the order j = 0 .. K-1
(each product and each sum its own rounded op: no fused multiply-add, whose rounding would
depend on the kernel's vector width).
"""

from __future__ import annotations

from typing import Optional

import torch


def conv_window(state: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
    """``[state; inputs]`` along time: ``state`` ``[..., K-1, C]``, ``inputs`` ``[..., n, C]`` ->
    ``[..., K-1+n, C]`` in ``inputs``' dtype."""
    return torch.cat([state.to(inputs.dtype), inputs], dim=-2)


def conv_taps(window: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """The convolution's output ``[..., n, C]`` over ``window`` ``[..., K-1+n, C]`` (a state and n
    inputs); ``weight`` ``[C, K]`` (tap K-1 reads the newest input), ``bias`` ``[C]`` or None."""
    taps = weight.shape[-1]
    rows = window.shape[-2] - taps + 1
    out = window[..., 0:rows, :] * weight[:, 0]
    for j in range(1, taps):  # fixed order: the same sum for a token whatever the pass
        out = out + window[..., j:j + rows, :] * weight[:, j]
    return out if bias is None else out + bias


def conv_state_after(window: torch.Tensor, taps: int) -> torch.Tensor:
    """The state after the window's inputs: its last ``taps - 1`` rows (from the old state where
    fewer inputs came), ``[..., K-1, C]``."""
    return window[..., window.shape[-2] - (taps - 1):, :]
