"""Chapter 07: quantize a loaded model's linear layers in place, by scheme name.

    model, tok = load_model("tinylab")
    quantize_model(model, "int4-g128")                       # round to nearest, per group of 128
    quantize_model(model, "gptq-int4-g128", calibration=batches)   # error-compensating (needs data)
    quantize_model(model, "w8a8", calibration=batches, alpha=0.5)  # + SmoothQuant smoothing
    quantized_weight_bytes(model)                            # what the weights now take

Every scheme swaps each decoder layer's nn.Linear (q/k/v/o, gate/up/down) for a ``QuantLinear``:
same inputs, same outputs, integers inside. The embedding, the norms and the (often tied) LM head
stay in floating point, as in most weight-only schemes: they are a small share of a large model's
bytes (not of tinylab's, whose 1024 x 256 embedding is a third of it) and the most sensitive part.

    scheme             weights                      activations        granularity
    int8               int8 symmetric               as is              per output channel
    int8-per-tensor    int8 symmetric               as is              one scale per matrix
    int4-g32/64/128    int4 with zero points        as is              per group of G inputs
    int4-per-channel   int4 with zero points        as is              per output channel
    int4-per-tensor    int4 with zero points        as is              one (scale, zero) per matrix
    gptq-int4-g128     int4, GPTQ-rounded           as is              per group of 128
    w8a8               int8 symmetric               int8, per token    per channel x per token

Round to nearest (RTN) rounds every weight on its own. GPTQ (Frantar et al., "GPTQ: Accurate
Post-Training Quantization for Generative Pre-trained Transformers", ICLR 2023) rounds the
columns one by one and pushes each column's rounding error onto the columns not yet rounded,
weighted by how the layer's real inputs correlate (the Hessian H = 2 X^T X of the layer's
squared output error). SmoothQuant (Xiao et al., ICML 2023) divides each input channel j of x
by s_j and multiplies W's column j by it, s_j = max|x_j|^alpha / max|W_j|^(1 - alpha):
outlier channels of x shrink, W absorbs them.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from kernels.quant_matmul import (
    BACKENDS,
    QuantizedWeight,
    prepare,
    quant_matmul,
    quantize,
    w8a8_matmul_ref,
)
from kernels.quant_matmul.cpu_native import native_linear
from kernels.quant_matmul.reference import (
    INT4_LEVELS,
    INT8_MAX,
    TINY_SCALE,
    int4_scale_and_zero,
    pack_int4,
)

GPTQ_DAMP = 0.01  # GPTQ's "percdamp": add 1% of H's mean diagonal, so H stays invertible
GPTQ_BLOCK = 128  # columns updated together (the paper's lazy batch); results do not depend on it
PREPARED_BACKENDS = ("packed", "native")  # backends with per-weight work done once, in set_backend
HEAD_GROUP = 32  # the LM head's groups (``quantize_lm_head``): as GGUF's Q8_0 and Q4_0 blocks
HEAD_BITS = (8, 4)  # quantize_lm_head's choices: int8 (as Q8_0), int4 (as Q4_1: a scale and a zero)
SMOOTH_MIN = 1e-5  # no smoothing factor below this: a dead channel must not become a division by ~0


@dataclass(frozen=True)
class QuantScheme:
    """What one scheme name means."""

    name: str
    bits: int
    group_size: int | None = None  # None: per output channel (G = K)
    per_tensor: bool = False
    method: str = "rtn"  # "rtn" (round to nearest) or "gptq"
    activations: bool = False  # W8A8: activations quantized to int8 per token, at run time


SCHEMES = {s.name: s for s in (
    QuantScheme("int8", 8),
    QuantScheme("int8-per-tensor", 8, per_tensor=True),
    QuantScheme("int4-g32", 4, 32),
    QuantScheme("int4-g64", 4, 64),
    QuantScheme("int4-g128", 4, 128),
    QuantScheme("int4-per-channel", 4),
    QuantScheme("int4-per-tensor", 4, per_tensor=True),
    QuantScheme("gptq-int4-g128", 4, 128, method="gptq"),
    QuantScheme("w8a8", 8, activations=True),
)}


def get_scheme(name: str) -> QuantScheme:
    if name not in SCHEMES:
        raise ValueError(f"scheme: {name!r} is not a quantization scheme; "
                         f"use one of {list(SCHEMES)}")
    return SCHEMES[name]


# ---- the layer -----------------------------------------------------------------------------------


class QuantLinear(nn.Module):
    """A drop-in nn.Linear whose weight is a ``QuantizedWeight``
    (buffers, so ``.to(device)`` works).

    forward(x [..., K]) -> [..., N]. ``backend`` picks the kernel (see kernels/quant_matmul):
    "torch" (the readable oracle), "packed" (torch's CPU ops, bf16 inside), "native" (our C kernel,
    x rounded to int8 per 32 inputs), "triton", "cuda".
    ``act_quant`` makes it W8A8;
    ``smooth`` [K] divides x first (SmoothQuant; W was multiplied by it).
    With "packed", torch's own copy of an int4 weight sits beside ours (``quantized_weight_bytes``
    counts the format once).
    """

    def __init__(self, qw: QuantizedWeight, bias: Tensor | None = None, backend: str = "torch",
                 act_quant: bool = False, smooth: Tensor | None = None):
        super().__init__()
        self.bits, self.group_size = qw.bits, qw.group_size
        self.out_features, self.in_features = qw.shape
        self.register_buffer("qweight", qw.qweight)
        self.register_buffer("scales", qw.scales)
        self.register_buffer("zeros", qw.zeros)
        self.register_buffer("smooth", smooth)
        self.bias = (None if bias is None
                     else nn.Parameter(bias.detach().clone(), requires_grad=False))
        self.act_quant = act_quant
        self.set_backend(backend)

    @property
    def qw(self) -> QuantizedWeight:
        return QuantizedWeight(self.bits, self.qweight, self.scales, self.zeros, self.group_size,
                               (self.out_features, self.in_features))

    def set_backend(self, backend: str) -> None:
        """Switch kernels; "packed" builds torch's layout once here and "native" checks the
        weight once (not on every call)."""
        if backend not in BACKENDS:
            raise ValueError(f"backend: {backend!r} is not one of {BACKENDS}")
        self.backend = backend
        from kernels.quant_matmul import why_backend_cannot_run

        usable = (backend in PREPARED_BACKENDS and not self.act_quant
                  and why_backend_cannot_run(backend, self.qw) is None)
        self._prepared = prepare(self.qw, backend) if usable else None

    def forward(self, x: Tensor) -> Tensor:
        if self.backend == "native" and self._prepared is not None and self.smooth is None:
            # a decode step's hot path: no dispatch
            return native_linear(x, self._prepared, self.bias)
        if self.smooth is not None:
            x = x / self.smooth.to(x.dtype)  # [..., K]
        if self.act_quant:
            return w8a8_matmul_ref(x, self.qw, self.bias)
        return quant_matmul(x, self.qw, self.bias, backend=self.backend, prepared=self._prepared)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bits={self.bits}, group_size={self.group_size}, w8a8={self.act_quant}, "
                f"backend={self.backend!r}")


# ---- which layers, and swapping them -------------------------------------------------------------


def quantizable_linears(model: nn.Module) -> dict[str, nn.Linear]:
    """Every nn.Linear inside the decoder layers, by name ("layers.0.self_attn.q_proj", ...)."""
    return {name: m for name, m in model.named_modules()
            if name.startswith("layers.") and isinstance(m, nn.Linear)}


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name), child, new)


def _weight_of(name: str, module: nn.Module) -> Tensor:
    weight = getattr(module, "weight", None)
    if not isinstance(weight, Tensor) or weight.dim() != 2:
        raise ValueError(f"{name}: has no 2-D weight to quantize (got {type(weight).__name__}); "
                         "only nn.Linear layers can be quantized")
    return weight.detach()


def group_size_for(scheme: QuantScheme, in_features: int) -> int | None:
    """The scheme's group size, or, where it does not divide K, the largest halving of it that does.

    tinylab's down_proj has K = 704 = 11 x 64, so "int4-g128" quantizes it in groups of 64 (smaller
    groups: a little more accurate, a few more bytes). None means per channel (or per tensor)."""
    g = scheme.group_size
    if g is None or scheme.per_tensor:
        return g
    while g > 1 and in_features % g:
        g //= 2
    # no fit: let quantize() explain
    return g if in_features % g == 0 and g > 1 else scheme.group_size


def _warn_smaller_groups(model: nn.Module, scheme: QuantScheme) -> None:
    changed = {f"{n} (K={m.in_features}): {group_size_for(scheme, m.in_features)}"
               for n, m in quantizable_linears(model).items()
               if group_size_for(scheme, m.in_features) != scheme.group_size}
    if changed:
        warnings.warn(f"scheme {scheme.name!r}: group size {scheme.group_size} does not divide "
                      f"every layer's input width; using smaller groups for {len(changed)} "
                      f"layer(s), e.g. {sorted(changed)[:3]}", RuntimeWarning, stacklevel=3)


def quantize_linear(name: str, linear: nn.Module, scheme: QuantScheme, backend: str = "torch",
                    smooth: Tensor | None = None) -> QuantLinear:
    """Round-to-nearest ``QuantLinear`` for one layer
    (``smooth`` [K]: SmoothQuant factors, W8A8 only)."""
    weight = _weight_of(name, linear).float()
    if smooth is not None:
        weight = weight * smooth[None, :]  # column j times s_j; forward divides x_j by s_j
    try:
        qw = quantize(weight, scheme.bits, group_size_for(scheme, weight.shape[1]),
                      per_tensor=scheme.per_tensor)
    except ValueError as e:
        raise ValueError(f"{name} (scheme {scheme.name!r}): {e}") from None
    return QuantLinear(qw, linear.bias, backend, act_quant=scheme.activations, smooth=smooth)


def quantize_model(model: nn.Module, scheme: str, *, calibration: Sequence[Tensor] | None = None,
                   alpha: float | None = None, backend: str = "torch") -> nn.Module:
    """Quantize ``model``'s decoder linears in place by scheme name; returns the model.

    calibration: a few batches of token ids [B, T] (needed by "gptq-*" and by ``alpha``).
    alpha: SmoothQuant's migration strength in [0, 1] for "w8a8" (None: no smoothing).
    backend: the kernel each QuantLinear uses (W8A8 always runs the reference).
    """
    s = get_scheme(scheme)
    _check_options(model, s, calibration, alpha, backend)
    _warn_smaller_groups(model, s)
    if s.method == "gptq":
        return _gptq_model(model, s, calibration, backend)
    smooth = smoothing_factors(model, calibration, alpha) if alpha is not None else {}
    for name, linear in quantizable_linears(model).items():
        _replace(model, name, quantize_linear(name, linear, s, backend, smooth.get(name)))
    return model


def _check_options(model, s: QuantScheme, calibration, alpha, backend) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"backend: {backend!r} is not one of {BACKENDS}")
    if not quantizable_linears(model):
        already = any(isinstance(m, QuantLinear) for m in model.modules())
        raise ValueError("model: has no nn.Linear inside its decoder layers" +
                         ("; it is already quantized: load a fresh model to try another scheme"
                          if already else ""))
    if alpha is not None:
        if not s.activations:
            raise ValueError(f"alpha: SmoothQuant smoothing applies to 'w8a8' only, not {s.name!r}")
        if not 0.0 <= alpha <= 1.0:
            raise ValueError("alpha: must be in [0, 1] (0.5 is SmoothQuant's default), "
                             f"got {alpha}")
    needs_data = s.method == "gptq" or alpha is not None
    if needs_data and not calibration:
        raise ValueError(f"calibration: scheme {s.name!r}"
                         f"{' with alpha' if alpha is not None else ''} needs a few batches of "
                         "token ids [B, T] from text like what the model will see")


# ---- calibration: what the layers' inputs look like ---------------------------------------------


def calibration_batches(token_ids: Sequence[int], batch_size: int, seq_len: int) -> list[Tensor]:
    """Cut one long stream of token ids (e.g. documents encoded back to back) into [batch_size,
    seq_len] batches, dropping the ragged end. A few batches of a few hundred tokens are enough."""
    per_batch = batch_size * seq_len
    if batch_size < 1 or seq_len < 1 or len(token_ids) < per_batch:
        raise ValueError(f"token_ids: {len(token_ids)} ids cannot fill one "
                         f"[{batch_size}, {seq_len}] batch; "
                         "pass more text or smaller sizes (both >= 1)")
    ids = torch.tensor(list(token_ids[: len(token_ids) // per_batch * per_batch]), dtype=torch.long)
    return list(ids.view(-1, batch_size, seq_len))  # [num_batches, B, T] -> batches of [B, T]


def _run_batches(model: nn.Module, batches: Iterable[Tensor]) -> None:
    with torch.no_grad():
        for ids in batches:
            if ids.dim() != 2 or ids.dtype != torch.long:
                raise ValueError(f"calibration: each batch must be token ids int64 [B, T], got "
                                 f"{ids.dtype} {tuple(ids.shape)}")
            model(ids)


def collect_inputs(model: nn.Module, names: Sequence[str], batches: Iterable[Tensor],
                   reduce) -> dict[str, Tensor]:
    """Run ``batches`` through ``model`` and fold every input x [tokens, K] of the named layers
    into ``reduce(state_or_None, x) -> state`` (per layer).
    Hooks are removed afterwards, whatever happens."""
    state: dict[str, Tensor] = {}
    modules = dict(model.named_modules())

    def hook_for(name):
        def hook(_module, args):
            x = args[0].detach().reshape(-1, args[0].shape[-1]).float()  # [tokens, K]
            state[name] = reduce(state.get(name), x)
        return hook

    handles = [modules[n].register_forward_pre_hook(hook_for(n)) for n in names]
    try:
        _run_batches(model, batches)
    finally:
        for h in handles:
            h.remove()
    return state


def layer_inputs(model: nn.Module, names: Sequence[str],
                 batches: Iterable[Tensor]) -> dict[str, Tensor]:
    """Every input row x [tokens, K] the named layers saw while ``batches`` ran through ``model``,
    stacked (what GPTQ's Hessian 2/n X^T X is built from, and what we measure output errors on)."""
    return collect_inputs(model, names, batches,
                          lambda acc, x: x if acc is None else torch.cat((acc, x)))


def activation_channel_max(model: nn.Module, batches: Iterable[Tensor]) -> dict[str, Tensor]:
    """max |x_j| over every calibration token, per input channel j of
    every decoder linear: [K] each."""
    return collect_inputs(model, list(quantizable_linears(model)), batches,
                          lambda m, x: (x.abs().amax(0) if m is None
                                        else torch.maximum(m, x.abs().amax(0))))


def smoothing_factors(model: nn.Module, batches: Sequence[Tensor],
                      alpha: float) -> dict[str, Tensor]:
    """SmoothQuant's s_j = max|x_j|^alpha / max|W_j|^(1 - alpha) for
    every decoder linear: [K] each."""
    act_max = activation_channel_max(model, batches)
    factors = {}
    for name, linear in quantizable_linears(model).items():
        w_max = linear.weight.detach().float().abs().amax(0).clamp(min=SMOOTH_MIN)  # [K]
        s = act_max[name].clamp(min=SMOOTH_MIN).pow(alpha) / w_max.pow(1 - alpha)
        factors[name] = s.clamp(min=SMOOTH_MIN)
    return factors


def relative_error(approx: Tensor, exact: Tensor) -> float:
    """||approx - exact|| / ||exact|| (Frobenius), in fp32: one number for how far a quantized
    layer's outputs (or weights) land from the float ones."""
    if approx.shape != exact.shape:
        raise ValueError(f"approx: shape {tuple(approx.shape)} must equal exact's "
                         f"{tuple(exact.shape)}")
    exact = exact.float()
    return ((approx.float() - exact).norm() / exact.norm().clamp(min=TINY_SCALE)).item()


def compare_logits(reference: nn.Module | Sequence[Tensor], model: nn.Module,
                   batches: Sequence[Tensor], ignore_target: int | None = None) -> dict[str, float]:
    """How far ``model`` (quantized) strays from ``reference`` (its float self, or that model's
    logits [B, T, V] on each batch, computed once for many comparisons) over every position of
    ``batches`` (token ids [B, T]), teacher-forced, one forward each:

        top1_agreement   share of positions where both models' most likely next token agree
        kl_to_reference  mean KL(p_reference || p_model) per position, in nats
        perplexity       exp(mean NLL) of ``model`` on the text's real next tokens, except those
                         equal to ``ignore_target`` (e.g. the BOS starting the next of several
                         documents packed in a row: no model can predict where a document begins)
        tokens           positions scored

    A task suite needs hundreds of examples before a one-point difference means anything; these
    measures see every token of a few short documents, so small differences between schemes show."""
    agree = kl = nll = 0.0
    positions = predicted = 0
    with torch.no_grad():
        for b, ids in enumerate(batches):
            if ids.dim() != 2 or ids.dtype != torch.long or ids.shape[1] < 2:
                raise ValueError(f"batches: each must be token ids int64 [B, T] with T >= 2, got "
                                 f"{ids.dtype} {tuple(ids.shape)}")
            logits = reference(ids) if isinstance(reference, nn.Module) else reference[b]
            ref = torch.log_softmax(logits.float(), -1)  # [B, T, V]
            got = torch.log_softmax(model(ids).float(), -1)  # [B, T, V]
            agree += (ref.argmax(-1) == got.argmax(-1)).sum().item()
            kl += (ref.exp() * (ref - got)).sum().item()
            targets = ids[:, 1:]  # [B, T - 1]: position t predicts token t + 1
            scored = targets != (-1 if ignore_target is None else ignore_target)  # [B, T - 1]
            nll -= got[:, :-1].gather(-1, targets[..., None])[..., 0][scored].sum().item()
            positions, predicted = positions + ids.numel(), predicted + int(scored.sum())
    if positions == 0:
        raise ValueError("batches: no token ids to compare on; pass a few [B, T] batches")
    return {"top1_agreement": agree / positions, "kl_to_reference": kl / positions,
            "perplexity": math.exp(nll / max(predicted, 1)), "tokens": positions}


# ---- GPTQ ----------------------------------------------------------------------------------------


def input_hessians(model: nn.Module, names: Sequence[str],
                   batches: Sequence[Tensor]) -> dict[str, Tensor]:
    """H = 2/n * X^T X [K, K] for each named layer, over all n calibration tokens."""
    def reduce(acc, x):
        h, n = acc if acc is not None else (torch.zeros(x.shape[1], x.shape[1]), 0)
        return h + 2 * x.T @ x, n + x.shape[0]

    sums = collect_inputs(model, names, batches, reduce)
    return {name: h / n for name, (h, n) in sums.items()}


def _inverse_hessian_factor(hessian: Tensor, weight: Tensor) -> Tensor:
    """Upper Cholesky factor of H^-1 (damped; dead inputs made harmless):
    what GPTQ's updates use."""
    h = hessian.clone()
    dead = h.diagonal() == 0  # an input that was always 0: its column cannot matter
    h[dead, dead] = 1.0
    weight[:, dead] = 0.0
    h += GPTQ_DAMP * h.diagonal().mean() * torch.eye(h.shape[0])
    return torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)


def _grid(w: Tensor, bits: int) -> tuple[Tensor, Tensor]:
    """(scale, zero) [N] for a group of columns w [N, G], the same grids ``quantize`` uses."""
    if bits == 8:
        return (w.abs().amax(1) / INT8_MAX).clamp(min=TINY_SCALE), torch.zeros(w.shape[0])
    return int4_scale_and_zero(w.amin(1), w.amax(1))


def _round(col: Tensor, scale: Tensor, zero: Tensor, bits: int) -> Tensor:
    lo, hi = (-INT8_MAX, INT8_MAX) if bits == 8 else (0, INT4_LEVELS)
    return (col / scale + zero).round().clamp(lo, hi)


def gptq_quantize(weight: Tensor, hessian: Tensor, bits: int = 4,
                  group_size: int | None = 128) -> QuantizedWeight:
    """GPTQ for one [N, K] weight given its inputs' Hessian [K, K]
    (Frantar et al. 2023, Algorithm 1).

    Column by column: round column i, then spread its error e_i = (w_i - q_i) / [H^-1]_ii over the
    columns to its right, w_j -= e_i * [H^-1]_ij, so they compensate for it. A group's (scale, zero)
    is fixed when its first column comes up, from the weights as they are by then.
    """
    n, k = weight.shape
    g = k if group_size is None else group_size
    w = weight.detach().float().clone()
    hinv = _inverse_hessian_factor(hessian.float(), w)
    # a group never straddles blocks
    block = g if (g <= GPTQ_BLOCK or g % GPTQ_BLOCK) else GPTQ_BLOCK
    q = torch.zeros(n, k)
    scales, zeros = torch.zeros(n, k // g), torch.zeros(n, k // g)
    for i1 in range(0, k, block):
        i2 = min(i1 + block, k)
        w1, err1 = w[:, i1:i2].clone(), torch.zeros(n, i2 - i1)
        for i in range(i2 - i1):
            col = i1 + i
            if col % g == 0:  # a new group: its grid from the current (already compensated) weights
                group_w = w[:, col:col + g] if i == 0 else w1[:, i:i + g]
                scales[:, col // g], zeros[:, col // g] = _grid(group_w, bits)
            s, z = scales[:, col // g], zeros[:, col // g]
            q[:, col] = _round(w1[:, i], s, z, bits)
            err = (w1[:, i] - (q[:, col] - z) * s) / hinv[col, col]
            w1[:, i:] -= err[:, None] * hinv[col, col:i2][None, :]
            err1[:, i] = err
        w[:, i2:] -= err1 @ hinv[i1:i2, i2:]  # the block's errors, onto every later column at once
    if bits == 8:
        return QuantizedWeight(8, q.to(torch.int8), scales, None, g, (n, k))
    return QuantizedWeight(4, pack_int4(q), scales, zeros, g, (n, k))


def _gptq_model(model: nn.Module, s: QuantScheme, batches: Sequence[Tensor],
                backend: str) -> nn.Module:
    """Layer by layer: layer i's Hessians are measured with layers < i already quantized, so each
    layer also compensates what the earlier ones got wrong."""
    linears = quantizable_linears(model)
    for i in range(len(model.layers)):
        names = [n for n in linears if n.startswith(f"layers.{i}.")]
        hessians = input_hessians(model, names, batches)
        for name in names:
            lin = linears[name]
            qw = gptq_quantize(_weight_of(name, lin), hessians[name], s.bits,
                               group_size_for(s, lin.in_features))
            _replace(model, name, QuantLinear(qw, lin.bias, backend))
    return model


# ---- bytes ---------------------------------------------------------------------------------------


def weight_bytes_breakdown(model: nn.Module) -> dict[str, int]:
    """Bytes of the model's weights by kind: quantized decoder linears (integers + scales +
    zero points), a quantized LM head (``quantize_lm_head``), float linears, embedding
    (counted once when the LM head is tied to it), norms and the rest."""
    out = {"quantized linears": 0, "quantized lm_head": 0, "float linears": 0,
           "embedding and lm_head": 0, "norms and other": 0}
    seen: set[int] = set()
    for name, module in model.named_modules():
        if isinstance(module, QuantLinear):
            kind = "quantized lm_head" if name == "lm_head" else "quantized linears"
            tensors = [t for t in module.buffers(recurse=False) if t is not None]
            tensors += list(module.parameters(recurse=False))
        else:
            tensors = list(module.parameters(recurse=False))
            kind = ("float linears" if isinstance(module, nn.Linear) and name.startswith("layers.")
                    else "embedding and lm_head" if isinstance(module, (nn.Embedding, nn.Linear))
                    else "norms and other")
        for t in tensors:
            if id(t) not in seen:
                seen.add(id(t))
                out[kind] += t.nbytes
    return out


def quantized_weight_bytes(model: nn.Module) -> int:
    """All weight bytes of ``model`` as it is now (quantized or not): the sum of the breakdown."""
    return sum(weight_bytes_breakdown(model).values())


def quantize_lm_head(model: nn.Module, backend: str = "torch",
                     qw: QuantizedWeight | None = None, bits: int = 8) -> nn.Module:
    """Give ``model`` an int8 (``bits=8``) or int4 (``bits=4``) LM head in groups of
    ``HEAD_GROUP``, or ``qw`` (e.g. a GGUF file's Q8_0 head), in place; returns the model. The
    embedding stays float: a token's lookup reads one row of it, while the head reads ALL of it
    for every decoded token (SmolLM2: 49,152 x 576, 108 MiB in fp32, the largest matrix). A tied
    head is untied: the quantized copy is extra bytes on disk and in memory, but a quarter (int8)
    or about a fifth (int4, with a scale and a zero per group) of the bytes each decode step reads.
    With int4 decoder linears the int8 head is still a third of a step's bytes; an int4 head
    trades some of the logits' precision for them (benchmarks/quantization.md measures both)."""
    if bits not in HEAD_BITS:
        raise ValueError(f"bits: the LM head is quantized to one of {HEAD_BITS} bits, got {bits!r}")
    head = getattr(model, "lm_head", None)
    if isinstance(head, QuantLinear):
        raise ValueError("model: its LM head is already quantized")
    weight = _weight_of("lm_head", head)
    if qw is None:
        qw = quantize(weight.float(), bits,
                      group_size_for(QuantScheme("head", bits, HEAD_GROUP), weight.shape[1]))
    elif qw.shape != tuple(weight.shape):
        raise ValueError(f"qw: the head is {list(weight.shape)}, got a {list(qw.shape)} weight")
    model.lm_head = QuantLinear(qw, head.bias, backend)
    return model


def set_backend(model: nn.Module, backend: str) -> None:
    """Switch every QuantLinear of ``model`` to another kernel backend."""
    for module in model.modules():
        if isinstance(module, QuantLinear):
            module.set_backend(backend)


def use_quantized_weights(model: nn.Module, weights: dict[str, QuantizedWeight],
                          backend: str = "torch") -> nn.Module:
    """Swap the named decoder linears for QuantLinears holding already-quantized weights
    (e.g. a GGUF file's blocks: ``engine.loading.gguf.quantized_linear_weights``),
    in place; returns the model."""
    linears = quantizable_linears(model)
    for name, qw in weights.items():
        if name not in linears:
            raise ValueError(f"weights: {name!r} is not a float linear "
                             "of this model's decoder layers")
        if qw.shape != tuple(linears[name].weight.shape):
            raise ValueError(f"weights: {name} is {list(qw.shape)}, the model's layer is "
                             f"{list(linears[name].weight.shape)}")
        _replace(model, name, QuantLinear(qw, linears[name].bias, backend))
    return model
