"""The native decode attention (``_decode_kernel.py``) against torch's batched products, and its fallbacks."""

from __future__ import annotations

import shutil

import pytest
import torch

from agentrl.engines import _decode_kernel, _ragged

HAS_COMPILER = bool(shutil.which("cc") or shutil.which("gcc"))


@pytest.fixture
def fresh_kernel(monkeypatch, tmp_path):
    """kernel() built again into an empty cache directory, and forgotten afterwards."""
    monkeypatch.setenv("AGENTRL_CACHE", str(tmp_path))
    monkeypatch.setattr(_decode_kernel, "_loaded", {})
    return tmp_path


def ragged_step(head_dim: int = 32, query_heads: int | None = None):
    """A cache of 6 slots with random K/V and 4 decode rows (6 query heads, 2 K/V heads) in scattered
    slots at unequal lengths; ``query_heads`` given: the kernel is built for this shape."""
    torch.manual_seed(0)
    cache = _ragged.SlotKVCache(num_layers=2, slots=6, kv_heads=2, head_dim=head_dim, max_len=128, dtype=torch.float32,
                                device=torch.device("cpu"), initial_len=64, query_heads=query_heads)
    for tensor in cache.keys + cache.values:
        tensor.normal_()
    slots, positions = [4, 0, 2, 5], [50, 3, 0, 17]
    n, heads = len(slots), 6
    query, key, value = torch.randn(n, heads, head_dim), torch.randn(n, 2, head_dim), torch.randn(n, 2, head_dim)
    return cache, slots, positions, query, key, value


@pytest.mark.parametrize("query_heads", [None, 6], ids=["generic", "built-for-the-shape"])
def test_the_kernel_is_built_where_a_compiler_exists_and_attends_each_row_as_torch_does(fresh_kernel, monkeypatch, query_heads):
    cache, slots, positions, query, key, value = ragged_step(query_heads=query_heads)
    assert cache.kernel_shape == (None if query_heads is None else (3, 32))
    kernel = _decode_kernel.kernel(cache.kernel_shape)
    assert (kernel is not None) == HAS_COMPILER
    if kernel is None:
        return
    assert len(list(fresh_kernel.joinpath("kernels").glob("decode_attention-*.so"))) == 1
    layout = _ragged.build_layout(cache, slots, positions, (), torch.device("cpu"))
    assert layout.decode_lengths.tolist() == [51, 4, 1, 18] and layout.decode_mask is None
    threads = torch.get_num_threads()
    with torch.inference_mode():
        native = [_ragged.attend(layer, query, key, value, layout, 0.125) for layer in range(2)]
        torch.set_num_threads(2)  # rows spread over two OpenMP threads: each row's sums are the same
        try:
            assert all(torch.equal(_ragged.attend(layer, query, key, value, layout, 0.125), native[layer]) for layer in range(2))
        finally:
            torch.set_num_threads(threads)
    monkeypatch.setattr(_decode_kernel, "kernel", lambda shape=None: None)  # torch's batched products over the padded slot range
    padded = _ragged.build_layout(cache, slots, positions, (), torch.device("cpu"))
    assert padded.decode_lengths is None and padded.decode_mask.shape == (6, 1, 1, 51)
    with torch.inference_mode():
        reference = [_ragged.attend(layer, query, key, value, padded, 0.125) for layer in range(2)]
    for a, b in zip(native, reference):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-5), (a - b).abs().max()
    # -ffast-math at compile time only: loading the library must not set flush-to-zero for the process
    assert torch.tensor([1e-40]).mul(1.0).item() != 0.0


def test_heads_the_vectors_do_not_divide_and_other_dtypes_take_torchs_path():
    cache_k = torch.zeros(2, 2, 8, 16)
    assert _decode_kernel.DecodeKernel.serves(cache_k)
    assert not _decode_kernel.DecodeKernel.serves(torch.zeros(2, 2, 8, 24))
    assert not _decode_kernel.DecodeKernel.serves(cache_k.bfloat16())
    assert not _decode_kernel.DecodeKernel.serves(cache_k.transpose(0, 1))
    cache, slots, positions, *_ = ragged_step(head_dim=24)
    layout = _ragged.build_layout(cache, slots, positions, (), torch.device("cpu"))
    assert layout.decode_lengths is None and layout.decode_mask.shape == (6, 1, 1, 51)


def test_a_failed_build_or_the_switch_falls_back_to_torch_without_an_error(fresh_kernel, monkeypatch):
    monkeypatch.setenv("CC", "false")  # a "compiler" that always fails
    assert _decode_kernel.kernel() is None
    cache, slots, positions, *_ = ragged_step()
    assert _ragged.build_layout(cache, slots, positions, (), torch.device("cpu")).decode_lengths is None
    monkeypatch.setattr(_decode_kernel, "_loaded", {})
    monkeypatch.delenv("CC")
    monkeypatch.setenv("AGENTRL_DECODE_KERNEL", "0")
    assert _decode_kernel.kernel() is None


def test_the_native_norm_rotary_and_swiglu_product_match_torchs_ops():
    kernel = _decode_kernel.kernel()
    assert (kernel is not None) == HAS_COMPILER
    if kernel is None:
        return
    from agentrl.engines._packed import rotate_half

    torch.manual_seed(1)
    hidden, delta, weight = torch.randn(5, 48), torch.randn(5, 48), torch.randn(48)
    expected_hidden = hidden + delta
    expected = torch.nn.functional.rms_norm(expected_hidden, (48,), weight, 1e-6)
    normed = kernel.add_rms_norm(hidden, delta, weight, 1e-6)
    assert torch.equal(hidden, expected_hidden)  # the residual add lands in place
    assert torch.allclose(normed, expected, atol=1e-6, rtol=1e-5)
    assert torch.allclose(kernel.add_rms_norm(hidden, None, weight, 1e-6), expected, atol=1e-6, rtol=1e-5)

    fused = torch.randn(5, 80) * 4  # one product's output: the gate's columns, then the up projection's
    before = fused.clone()
    gate, up = fused.split(40, dim=-1)  # views whose rows are 80 floats apart
    expected = torch.nn.functional.silu(gate) * up
    product = kernel.silu_mul(gate, up)
    assert product.is_contiguous() and torch.allclose(product, expected, atol=1e-6, rtol=1e-5)
    assert torch.equal(fused, before)  # a new tensor: the product's output is left as it was
    assert torch.allclose(kernel.silu_mul(gate.contiguous(), up.contiguous()), expected, atol=1e-6, rtol=1e-5)
    assert torch.allclose(kernel.silu_mul(gate.t(), up.t()), expected.t(), atol=1e-6, rtol=1e-5)  # copied first

    rows = torch.randn(5, 40)  # the query heads (3 x 8) beside 16 other columns, as in a fused projection
    x, rest = rows[:, :24].view(5, 3, 8), rows[:, 24:].clone()
    cos, sin = torch.randn(20, 8), torch.randn(20, 8)
    positions = torch.tensor([0, 19, 7, 7, 3])
    expected = x * cos[positions][:, None] + rotate_half(x) * sin[positions][:, None]
    assert torch.allclose(kernel.rotary_(x, cos, sin, positions), expected, atol=1e-6, rtol=1e-5)
    assert torch.allclose(rows[:, :24].view(5, 3, 8), expected, atol=1e-6, rtol=1e-5)  # in place, through the view
    assert torch.equal(rows[:, 24:], rest)  # the columns between the rows untouched
    with pytest.raises(ValueError, match="contiguous CPU float32"):
        kernel.silu_mul(gate.bfloat16(), up.bfloat16())
    with pytest.raises(ValueError, match="heads are contiguous"):
        kernel.rotary_(torch.randn(5, 8, 3).transpose(1, 2), cos, sin, positions)


def test_the_kernel_writes_each_decode_rows_kv_before_reading_it_from_strided_views_of_one_projection(monkeypatch):
    """attend() hands the decode rows' K/V to the native call (no separate scatter): the cache
    must hold exactly what torch's scatter writes, and the attention must read it (a row's last
    key is its own)."""
    kernel = _decode_kernel.kernel((3, 32))
    assert (kernel is not None) == HAS_COMPILER
    if kernel is None:
        return
    cache, slots, positions, query, key, value = ragged_step(query_heads=6)
    # query, key and value as views into one [n, (6 + 2 + 2) * 32] projection output, rows strided
    fused = torch.cat([query.flatten(1), key.flatten(1), value.flatten(1)], dim=1)
    q_view, k_view, v_view = (part.view(4, -1, 32) for part in fused.split([192, 64, 64], dim=1))
    assert not q_view.is_contiguous() and not k_view.is_contiguous()
    layout = _ragged.build_layout(cache, slots, positions, (), torch.device("cpu"))
    assert layout.decode_lengths is not None
    with torch.inference_mode():
        native = [_ragged.attend(layer, q_view, k_view, v_view, layout, 0.125) for layer in range(2)]

    # the reference: the same cache through torch's scatter and batched products
    monkeypatch.setattr(_decode_kernel, "kernel", lambda shape=None: None)
    reference_cache, *_ = ragged_step(query_heads=6)
    layout = _ragged.build_layout(reference_cache, slots, positions, (), torch.device("cpu"))
    with torch.inference_mode():
        reference = [_ragged.attend(layer, query, key, value, layout, 0.125) for layer in range(2)]
    for got, want in zip(cache.keys + cache.values, reference_cache.keys + reference_cache.values):
        assert torch.equal(got, want)
    for a, b in zip(native, reference):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-5), (a - b).abs().max()
