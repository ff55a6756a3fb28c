"""One engine step through a transformers model: a fast functional path and the generic one.

Both run the packed tokens of a step (``[T]`` ids, their positions, a ``StepLayout``) through the
model and return next-token logits for the requested rows only (the last prompt token of each
prefill and every decode token; the LM head is skipped for the others).

* ``PackedDecoderForward`` (Qwen2, Qwen3, Llama: RMSNorm, rotary, grouped-query
  attention, SwiGLU) calls the model's own parameters functionally: fused ``F.rms_norm``, a
  rotary table computed once by the model's rotary module, and ``attend`` on ``[T, heads, dim]``
  tensors with no transposes. It avoids most of the per-layer Python and small-op overhead of
  the module tree, which dominates a decode step of a small model. Numerically it is the same
  computation as transformers' forward (the tests compare logprobs with it to 1e-5).
* ``ModuleForward`` is the fallback for other architectures whose forward accepts a
  precomputed mask mapping: transformers' own forward with ``ragged_attention`` plugged into its
  attention interface.

Parameters are read at every call, except that on CPU in fp32 the fast path multiplies by
oneDNN copies of the weights, in oneDNN's layout, the query, key and value projections' stacked
and gate and up's stacked (``OneDNNLinear``): whoever changes the weights calls
``weights_changed()`` (the engine does on every update).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from agentrl.engines import _decode_kernel, _ragged

__all__ = [
    "make_forward", "fast_decoder_supported", "PackedDecoderForward", "ModuleForward", "OneDNNLinear", "rms_norm", "rotate_half",
]

_FAST_TYPES = {"qwen2", "qwen3", "llama"}
_STATIC_ROPE = {"default", "linear", "llama3", "yarn", "longrope"}  # inv_freq does not depend on the sequence


def make_forward(model: torch.nn.Module, max_len: int):
    """The fast path when the architecture is one it knows, else transformers' module forward."""
    return PackedDecoderForward(model, max_len) if fast_decoder_supported(model.base_model) else ModuleForward(model)


def fast_decoder_supported(decoder: torch.nn.Module) -> bool:
    """Whether a decoder stack (a causal LM's ``base_model``) is one the functional layer code
    computes exactly: RMSNorm, static rotary, grouped-query attention, SwiGLU, no sliding window.
    The trainer's packed forward (``trainer/packed.py``) calls the layers the same way."""
    config = decoder.config
    rotary = getattr(decoder, "rotary_emb", None)
    return (
        config.model_type in _FAST_TYPES
        and getattr(config, "hidden_act", None) == "silu"
        and rotary is not None
        and getattr(rotary, "rope_type", "default") in _STATIC_ROPE
        and not getattr(config, "use_sliding_window", False)
        and not getattr(config, "mlp_bias", False)  # the SwiGLU here has no biases (Llama can have them)
    )


class ModuleForward:
    def __init__(self, model: torch.nn.Module):
        self.decoder = model.base_model
        self.lm_head = model.get_output_embeddings()
        # Ragged attention reads no mask. Decoders with per-layer attention kinds (Qwen2/3, Gemma)
        # take a ready mapping, which skips their mask builders; the others (Llama, Mistral, Phi-3)
        # take only a tensor or None, and with None and no padding their builder returns None at once.
        layer_types = getattr(model.config, "layer_types", None)
        self.mask_mapping = {kind: None for kind in layer_types} if layer_types else None

    def weights_changed(self) -> None:
        """Nothing held: the module tree reads its parameters at each call."""

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, layout, rows: torch.Tensor | None) -> torch.Tensor:
        hidden = self.decoder(
            input_ids=ids[None],
            position_ids=positions[None],
            attention_mask=self.mask_mapping,
            use_cache=False,
            **{_ragged.LAYOUT_KWARG: layout},
        ).last_hidden_state[0]  # [T, hidden]
        if rows is not None:
            hidden = hidden[rows]
        return self.lm_head(hidden).float()  # [n, vocab]


class PackedDecoderForward:
    def __init__(self, model: torch.nn.Module, max_len: int):
        base = model.base_model
        config = model.config
        self.embed = base.embed_tokens
        self.layers = list(base.layers)
        self.norm = base.norm
        self.lm_head = model.get_output_embeddings()
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.eps = config.rms_norm_eps
        self.scaling = self.head_dim**-0.5
        # cos/sin for every position, from the model's own rotary module (same values it computes per call).
        with torch.no_grad():
            positions = torch.arange(max_len, device=self.embed.weight.device)[None]
            cos, sin = base.rotary_emb(self.embed.weight[:1], positions)
        self.cos, self.sin = cos[0], sin[0]  # [max_len, head_dim]
        # rotate_half(x) * sin == roll(x, half) * sin with the first half's sign moved onto the
        # table: the same products, bit for bit, without rotate_half's slice, negation and cat
        half = self.head_dim // 2
        self.sin_signed = torch.cat((-self.sin[:, :half], self.sin[:, half:]), dim=-1)
        self.linear = OneDNNLinear() if OneDNNLinear.serves(self.embed.weight) else TorchLinear()
        # CPU fp32: norms (with the residual add before them), rotary and SwiGLU's product in one
        # native pass each (``_decode_kernel.py``); None: through torch's ops
        weight = self.embed.weight
        cpu_fp32 = weight.device.type == "cpu" and weight.dtype == torch.float32 and self.head_dim % 2 == 0
        self.native = _decode_kernel.kernel((self.heads // self.kv_heads, self.head_dim)) if cpu_fp32 else None

    def weights_changed(self) -> None:
        """The parameters were updated in place: forget the oneDNN copies of the old ones."""
        if isinstance(self.linear, OneDNNLinear):
            self.linear.forget()

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, layout, rows: torch.Tensor | None) -> torch.Tensor:
        total = ids.shape[0]
        native, half = self.native, self.head_dim // 2
        if native is None:
            cos = self.cos[positions][:, None, :]  # [T, 1, head_dim]
            sin = self.sin_signed[positions][:, None, :]
        hidden = F.embedding(ids, self.embed.weight)  # [T, hidden], a new tensor: the residual adds go in place
        linear, norm = self.linear, self._add_norm
        mlp_out = None  # the previous layer's MLP output: the next norm adds it to the residual
        for index, layer in enumerate(self.layers):
            attn, mlp = layer.self_attn, layer.mlp
            x = norm(hidden, mlp_out, layer.input_layernorm)
            # one product for the three (views into its output, rows strided) where the copies are fused
            q, k, v = linear.many(x, (attn.q_proj, attn.k_proj, attn.v_proj))
            q = q.view(total, self.heads, self.head_dim)
            k = k.view(total, self.kv_heads, self.head_dim)
            v = v.view(total, self.kv_heads, self.head_dim)
            if hasattr(attn, "q_norm"):  # Qwen3 normalises each head before the rotary embedding
                q = rms_norm(q, attn.q_norm, self.head_dim, self.eps)
                k = rms_norm(k, attn.k_norm, self.head_dim, self.eps)
            if native is not None:
                native.rotary_(q, self.cos, self.sin, positions)
                native.rotary_(k, self.cos, self.sin, positions)
            else:
                q = (q * cos).add_(torch.roll(q, half, -1).mul_(sin))
                k = (k * cos).add_(torch.roll(k, half, -1).mul_(sin))
            attended = _ragged.attend(index, q, k, v, layout, self.scaling)  # [T, heads, head_dim]
            x = norm(hidden, linear(attended.view(total, -1), attn.o_proj), layer.post_attention_layernorm)
            gate, up = linear.many(x, (mlp.gate_proj, mlp.up_proj))
            mlp_out = linear(native.silu_mul(gate, up) if native is not None else F.silu(gate) * up, mlp.down_proj)
        if mlp_out is not None:
            hidden.add_(mlp_out)
        if rows is not None:
            hidden = hidden[rows]
        return linear(norm(hidden, None, self.norm), self.lm_head).float()  # [n, vocab]

    def _add_norm(self, hidden: torch.Tensor, delta: torch.Tensor | None, norm: torch.nn.Module) -> torch.Tensor:
        """``hidden += delta`` in place (a residual add, when given), then ``norm`` of ``hidden``."""
        if self.native is not None:
            return self.native.add_rms_norm(hidden, delta, norm.weight, _eps(norm, self.eps))
        if delta is not None:
            hidden.add_(delta)
        return rms_norm(hidden, norm, hidden.shape[-1], self.eps)


class OneDNNLinear:
    """``F.linear`` through oneDNN with a copy of each weight in oneDNN's blocked layout, CPU fp32.

    Why: a decode step multiplies a few dozen rows by every weight. Through torch's default (MKL)
    GEMM, or through oneDNN with a plain-layout copy, each call lays the weight out again for its
    kernel, and the 18M model's weights do not fit the last-level cache: the step's linears ran at
    about 0.8 of the matmul probe. With the copy already in the kernel's own layout
    (``mkldnn._reorder_linear_weight``, as torch's compiler does for frozen CPU weights) they run at
    the probe's rate, from a handful of rows to a thousand (figures in docs/benchmarks.md). Small
    weights on their own (the 1M model's) and single rows keep MKL: a oneDNN call has a larger
    fixed cost, which their few FLOPs do not repay. The 18M model's key and value projections,
    small too, go in one product with the query projection (``many``).
    The copy is made on first use and again after ``forget`` (the engine calls it on every weight
    update, a shared module's ``weights_changed`` included: torch's fused AdamW changes parameters
    without moving their version counters), or when a parameter visibly changed (another tensor,
    another storage, a moved version counter). Costs one extra copy of the weights in memory.
    """

    def __init__(self, *, min_weight_elements: int = 1 << 17, rows_hint: int = 64) -> None:
        # rows_hint: the rows oneDNN lays the copy out for; any row count runs on it
        self.min_weight_elements, self.rows_hint = min_weight_elements, rows_hint
        # per tuple of linear modules: what was copied (each weight and bias with its version and
        # storage), the oneDNN copy of their weights one above the other, their biases joined, and
        # each module's output width
        self._copies: dict[tuple[torch.nn.Module, ...], _FusedCopy] = {}

    @staticmethod
    def serves(weight: torch.Tensor) -> bool:
        return (
            weight.device.type == "cpu"
            and weight.dtype == torch.float32
            and type(weight.data) is torch.Tensor  # not a DTensor or another subclass
            and torch.backends.mkldnn.is_available()
        )

    def forget(self) -> None:
        """Drop every copy: the weights changed (the next call copies them again)."""
        self._copies.clear()

    def __call__(self, x: torch.Tensor, module: torch.nn.Module) -> torch.Tensor:
        return self.many(x, (module,))[0]

    def many(self, x: torch.Tensor, modules: tuple[torch.nn.Module, ...]) -> tuple[torch.Tensor, ...]:
        """Each module's ``F.linear`` of the same input ``x``: through one product on a copy of their
        weights stacked (the query, key and value projections: one oneDNN call, not three, and the
        key and value projections' small weights no longer alone), returned as views into its
        output, whose rows are then strided."""
        if x.shape[0] < 2 or max(m.weight.numel() for m in modules) < self.min_weight_elements:
            return tuple(F.linear(x, m.weight, m.bias) for m in modules)
        copy = self._copies.get(modules)
        if copy is None or copy.stamp != _stamp(modules):
            copy = self._copies[modules] = _FusedCopy.of(modules, self.rows_hint)
        out = torch.ops.mkldnn._linear_pointwise(x, copy.weight, copy.bias, "none", [], "")
        return out.split(copy.widths, dim=-1) if len(modules) > 1 else (out,)


def _parameters(modules: tuple[torch.nn.Module, ...]) -> tuple[torch.Tensor, ...]:
    return tuple(t for m in modules for t in (m.weight, m.bias) if t is not None)


def _stamp(modules: tuple[torch.nn.Module, ...]) -> tuple[tuple[int, int, int], ...]:
    """What identifies the parameters' current values: each tensor (its id: the copy holds the
    tensors, so no other takes it), its version and its storage."""
    return tuple((id(t), t._version, t.data_ptr()) for t in _parameters(modules))


@dataclass(frozen=True, eq=False)
class _FusedCopy:
    held: tuple[torch.Tensor, ...]  # the parameters copied, kept so that their ids stay theirs
    stamp: tuple[tuple[int, int, int], ...]
    weight: torch.Tensor  # oneDNN's blocked layout of the weights one above the other
    bias: torch.Tensor | None
    widths: tuple[int, ...]

    @classmethod
    def of(cls, modules: tuple[torch.nn.Module, ...], rows_hint: int) -> _FusedCopy:
        with torch.no_grad():
            weights = [m.weight.detach() for m in modules]
            stacked = weights[0] if len(weights) == 1 else torch.cat(weights)
            bias = None
            if any(m.bias is not None for m in modules):
                bias = torch.cat([m.bias.detach() if m.bias is not None else w.new_zeros(w.shape[0]) for m, w in zip(modules, weights)])
            return cls(_parameters(modules), _stamp(modules), torch.ops.mkldnn._reorder_linear_weight(stacked, rows_hint), bias,
                       tuple(w.shape[0] for w in weights))


class TorchLinear:
    """``F.linear`` itself, with the same interface as ``OneDNNLinear`` (GPU, bf16, sharded weights)."""

    def __call__(self, x: torch.Tensor, module: torch.nn.Module) -> torch.Tensor:
        return F.linear(x, module.weight, module.bias)

    def many(self, x: torch.Tensor, modules: tuple[torch.nn.Module, ...]) -> tuple[torch.Tensor, ...]:
        return tuple(F.linear(x, m.weight, m.bias) for m in modules)


plain_linear = TorchLinear()


def _eps(norm: torch.nn.Module, default: float) -> float:
    return getattr(norm, "variance_epsilon", getattr(norm, "eps", default))


def rms_norm(x: torch.Tensor, norm: torch.nn.Module, width: int, eps: float) -> torch.Tensor:
    eps = _eps(norm, eps)
    if x.dtype == torch.float32:
        return F.rms_norm(x, (width,), norm.weight, eps)
    # Low precision: normalise in fp32 and scale after casting back, as transformers does.
    return norm.weight * F.rms_norm(x.float(), (width,), None, eps).to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
