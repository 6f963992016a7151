"""dequantize_experts against the reference on fresh inputs: FP8 weights with partial blocks at the
edges, gate/up blocked as two projections, FP8 weights with one scale a row, slots -1 skipped, every
output dtype; the block-FP8 quantizer against transformers' own."""
import pytest
import torch

import ft_ops
from ft_ops import formats
from ft_ops.testing import reference
from helpers import DEVICES, require

pytestmark = pytest.mark.parametrize("device", DEVICES)


def fp8_bank(slots, rows, cols, parts, seed, scales="block"):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(slots, rows, cols, generator=gen) * torch.rand(slots, 1, 1, generator=gen) * 4
    w[0, : min(rows, 128), : min(cols, 128)] = 0  # an all-zero block: scale_inv 1
    if scales == "rows":  # every row its own power of two
        w[0, :1] = 0  # an all-zero row: scale 1
        return formats.quantize_fp8_rows(w * 2.0 ** torch.randint(-4, 5, (slots, rows, 1), generator=gen))
    return formats.quantize_fp8(w, parts)


@pytest.mark.parametrize("scales", ["block", "rows"])
@pytest.mark.parametrize("rows,cols,parts", [(256, 384, 2), (384, 130, 2), (192, 96, 1), (130, 48, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_matches_reference(device, rows, cols, parts, dtype, scales):
    require(device, "dequantize_experts")
    q, s = fp8_bank(5, rows, cols, parts, seed=rows + cols, scales=scales)
    slots = torch.tensor([3, -1, 0, 3, 4], dtype=torch.int32)
    got = ft_ops.dequantize_experts(q.to(device), s.to(device), slots.to(device), parts, dtype).cpu()
    want = reference.dequantize_experts(q, s, slots, parts, dtype)
    assert got.dtype == dtype and got.shape == (5, rows, cols)
    keep = slots >= 0
    # Both compute float(q) * scale_inv in float32 and round once to dtype: identical.
    assert torch.equal(got[keep], want[keep])


def test_values_are_the_blocks_scaled(device):
    """Hand-made: a 2-projection weight whose every block has its own scale."""
    require(device, "dequantize_experts")
    rows, cols = 2 * 130, 200  # two projections of 130 rows: blocks of 128 and 2 rows each
    q = torch.full((1, rows, cols), 1.0).to(formats.FP8_DTYPE)
    s = torch.arange(1, 4 * 2 + 1, dtype=torch.float32).reshape(1, 4, 2)
    out = ft_ops.dequantize_experts(q.to(device), s.to(device), torch.tensor([0], device=device), 2,
                                    torch.float32).cpu()[0]
    assert out[0, 0] == 1 and out[0, 128] == 2 and out[128, 0] == 3 and out[129, 199] == 4
    assert out[130, 0] == 5 and out[258, 0] == 7 and out[259, 199] == 8


def test_values_are_the_rows_scaled(device):
    """Hand-made: row r of each slot times its own scale, whatever the column (any `parts`)."""
    require(device, "dequantize_experts")
    rows, cols = 260, 200
    q = torch.full((2, rows, cols), 1.5).to(formats.FP8_DTYPE)
    s = torch.arange(1, 2 * rows + 1, dtype=torch.float32).reshape(2, rows)
    out = ft_ops.dequantize_experts(q.to(device), s.to(device), torch.tensor([1, 0], device=device), 2,
                                    torch.float32).cpu()
    assert torch.equal(out[0], 1.5 * s[1, :, None].expand(rows, cols))
    assert torch.equal(out[1], 1.5 * s[0, :, None].expand(rows, cols))


def test_errors(device):
    require(device, "dequantize_experts")
    q, s = fp8_bank(2, 256, 128, 2, seed=1)
    q, s = q.to(device), s.to(device)
    ids = torch.tensor([0], device=device)
    with pytest.raises(RuntimeError, match=r"weight must be float8_e4m3fn \(FP8\) or uint8 \(MXFP4 or int4 codes\), got Float"):
        ft_ops.dequantize_experts(q.float(), s, ids, 2)
    with pytest.raises(RuntimeError, match=r"must be \[2, 2, 1\]"):
        ft_ops.dequantize_experts(q, s[:, :1], ids, 2)
    with pytest.raises(RuntimeError, match="dtype must be"):
        ft_ops.dequantize_experts(q, s, ids, 2, torch.int32)
    with pytest.raises(RuntimeError, match=r"scale must be \[2, 256\] \(one scale a row of weight"):
        ft_ops.dequantize_experts(q, torch.ones(2, 255, device=device), ids, 2)
    if device == "cpu":
        with pytest.raises(RuntimeError, match="outside"):
            ft_ops.dequantize_experts(q, s, torch.tensor([2]), 2)


@pytest.mark.parametrize("scales", ["block", "rows"])
def test_opcheck_and_compile(device, scales):
    require(device, "dequantize_experts")
    q, s = fp8_bank(3, 256, 128, 2, seed=2, scales=scales)
    q, s = q.to(device), s.to(device)
    ids = torch.tensor([2, 0], device=device)
    args = (q, s, ids, 2, torch.bfloat16)
    # opcheck's test_schema runs arithmetic on every tensor argument, which torch does not implement
    # for float8 on the CPU; what it checks (no input mutated, the output aliases no input) is
    # checked directly below.
    torch.library.opcheck(torch.ops.freetoken.dequantize_experts.default, args,
                          test_utils=("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"))
    before = [t.clone() for t in (q.view(torch.uint8), s, ids)]
    out = torch.ops.freetoken.dequantize_experts.default(*args)
    assert all(torch.equal(a, b) for a, b in zip(before, (q.view(torch.uint8), s, ids)))
    assert out.untyped_storage().data_ptr() not in {t.untyped_storage().data_ptr() for t in (q, s, ids)}
    compiled = torch.compile(lambda a, b, c: ft_ops.dequantize_experts(a, b, c, 2, torch.bfloat16), fullgraph=True)
    assert torch.equal(compiled(q, s, ids), ft_ops.dequantize_experts(q, s, ids, 2, torch.bfloat16))


def test_quantizer_matches_transformers(device):
    """quantize_fp8 is transformers' block quantizer (scale 448 / amax, 1 for all-zero blocks,
    round to nearest even) on whole blocks, and extends it to partial edge blocks."""
    if device != "cpu":
        pytest.skip("a host-side function")
    fp8 = pytest.importorskip("transformers.integrations.finegrained_fp8")
    from transformers.utils.quantization_config import FineGrainedFP8Config

    class Quantizer:
        quantization_config = FineGrainedFP8Config(weight_block_size=(128, 128))

    w = torch.randn(3, 256, 384, dtype=torch.bfloat16)
    w[1, 128:, :128] = 0
    theirs = fp8.Fp8Quantize(Quantizer())._quantize_one("x.weight", w)
    q, s = formats.quantize_fp8(w)
    assert torch.equal(theirs["x.weight"].view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(theirs["x.weight_scale_inv"], s)
    q, s = formats.quantize_fp8(torch.randn(2, 2 * 130, 70), parts=2)
    assert q.shape == (2, 260, 70) and s.shape == (2, 4, 1)
