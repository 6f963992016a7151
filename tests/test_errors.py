"""Bad input gets a clear error naming the offending value (CPU kernels; the CUDA kernels share
the metadata checks in src/common/checks.h)."""
import re

import pytest
import torch

import ft_ops
from helpers import make_pool, require
from test_expert_gemm import random_problem, seed_of


@pytest.fixture
def pool():
    return make_pool(2, 8, 16, "cpu")


def test_expert_ids_out_of_range(pool):
    with pytest.raises(RuntimeError, match=r"expert_ids\[3\] \(flat\) is 8, outside \[0, 8\)"):
        ft_ops.dedup_and_admit(*pool.state, 0, torch.tensor([[1, 2], [3, 8]]))
    with pytest.raises(RuntimeError, match=r"is -1, outside \[0, 8\)"):
        ft_ops.slot_lookup(pool.slot_of, 0, torch.tensor([-1]))
    assert int(pool.clock) == 0, "a rejected call must not advance the clock"


def test_eviction_policy_and_its_state(pool):
    from ft_ops.policies import DUEL, HIT_DENSITY, new_policy_state, policy_id

    ids = torch.tensor([1])
    with pytest.raises(RuntimeError, match=r"policy must be 0 \(lru\), 1 \(opportunity\), 2 \(hitdensity\) or 3 \(duel\), got 4"):
        ft_ops.dedup_and_admit(*pool.state, 0, ids, 1.0, 0, 0, None, 4)
    with pytest.raises(RuntimeError, match=r"policy 2 \(hitdensity\) needs its policy_state"):
        ft_ops.dedup_and_admit(*pool.state, 0, ids, 1.0, 0, 0, None, HIT_DENSITY)
    state = new_policy_state(HIT_DENSITY, 2, 8, 16, "cpu")
    with pytest.raises(RuntimeError, match=r"policy_state is hit density's or Duel's: pass policy=2 or 3 to use it, or None with policy 0"):
        ft_ops.dedup_and_admit(*pool.state, 0, ids, 1.0, 0, 0, None, 0, policy_state=state)
    with pytest.raises(RuntimeError, match=r"2 \* layers \* experts \+ slots = 48 entries, got shape \[47\]"):
        ft_ops.dedup_and_admit(*pool.state, 0, ids, 1.0, 0, 0, None, HIT_DENSITY, policy_state=state[:47])
    with pytest.raises(RuntimeError, match=r"policy 3 \(duel\) needs its policy_state"):
        ft_ops.dedup_and_admit(*pool.state, 0, ids, 1.0, 0, 0, None, DUEL)
    with pytest.raises(RuntimeError, match=r"2 \* layers \* experts \+ slots \+ 21 = 69 entries, got shape \[48\]: "
                                           r"that is hit density's state, pass policy=2"):
        ft_ops.dedup_and_admit(*pool.state, 0, ids, 1.0, 0, 0, None, DUEL, policy_state=state)
    duel = new_policy_state(DUEL, 2, 8, 16, "cpu")
    with pytest.raises(RuntimeError, match=r"= 48 entries, got shape \[69\]: that is Duel's state, pass policy=3"):
        ft_ops.dedup_and_admit(*pool.state, 0, ids, 1.0, 0, 0, None, HIT_DENSITY, policy_state=duel)
    with pytest.raises(RuntimeError, match=r"= 69 entries, got shape \[68\]; ft_ops.policies.new_policy_state makes one"):
        ft_ops.dedup_and_admit(*pool.state, 0, ids, 1.0, 0, 0, None, DUEL, policy_state=duel[:68])
    with pytest.raises(RuntimeError, match=r"policy_state must be int64 .* got Int"):
        ft_ops.dedup_and_admit(*pool.state, 0, ids, 1.0, 0, 0, None, DUEL, policy_state=duel.int())
    with pytest.raises(RuntimeError, match=r"policy_state must be contiguous"):
        ft_ops.dedup_and_admit(*pool.state, 0, ids, 1.0, 0, 0, None, HIT_DENSITY,
                               policy_state=torch.stack([state, state], 1)[:, 0])
    with pytest.raises(RuntimeError, match=r"policy_state must be int64 \(ft_ops.policies.new_policy_state makes one\), got Double"):
        ft_ops.dedup_and_admit(*pool.state, 0, ids, 1.0, 0, 0, None, HIT_DENSITY, policy_state=state.double())
    from ft_ops.shadow_caches import ShadowCaches
    shadows = list(ShadowCaches(2, 8, 16, "cpu", duel).tensors)
    with pytest.raises(RuntimeError, match=r"shadows are Duel's shadow caches: pass policy=3 \(duel\) with them, or None "
                                           r"with policy 2"):
        ft_ops.dedup_and_admit(*pool.state, 0, ids, 1.0, 0, 0, None, HIT_DENSITY, policy_state=state, shadows=shadows)
    with pytest.raises(RuntimeError, match=r"shadows must be 9 tensors \(the LRU shadow's slot_of, .*got 8"):
        ft_ops.dedup_and_admit(*pool.state, 0, ids, 1.0, 0, 0, None, DUEL, policy_state=duel, shadows=shadows[:8])
    small = list(ShadowCaches(2, 8, 12, "cpu", duel).tensors)
    with pytest.raises(RuntimeError, match=r"shadows\[0:4\] hold a cache of 2 x 8 pairs and 12 slots; a shadow is the "
                                           r"pool's size \(2 x 8, 16 slots\)"):
        ft_ops.dedup_and_admit(*pool.state, 0, ids, 1.0, 0, 0, None, DUEL, policy_state=duel, shadows=small)
    with pytest.raises(RuntimeError, match=r"policy_state must be an int64 tensor .* = 48 entries, got shape \[69\]"):
        ft_ops.dedup_and_admit(*pool.state, 0, ids, 1.0, 0, 0, None, DUEL, policy_state=duel,
                               shadows=shadows[:8] + [duel])
    with pytest.raises(RuntimeError, match=r"shadows\[4\] shares memory with the pool's slot_of: a shadow holds "
                                           r"tensors of its own"):
        ft_ops.dedup_and_admit(*pool.state, 0, ids, 1.0, 0, 0, None, DUEL, policy_state=duel,
                               shadows=shadows[:4] + [pool.slot_of] + shadows[5:])
    with pytest.raises(RuntimeError, match=r"shadows\[8\] shares memory with shadows\[2\]"):
        ft_ops.dedup_and_admit(*pool.state, 0, ids, 1.0, 0, 0, None, DUEL, policy_state=duel,
                               shadows=shadows[:2] + [shadows[8][:16]] + shadows[3:])
    corrupt = [t.clone() for t in shadows]
    corrupt[5][3] = 99  # the hit-density shadow's owner_of
    with pytest.raises(RuntimeError, match=r"owner_of\[3\] is 99, outside \[-1, 16\): the pool state is corrupt"):
        ft_ops.dedup_and_admit(*pool.state, 0, ids, 1.0, 0, 0, None, DUEL, policy_state=duel, shadows=corrupt)
    behind = duel.clone()
    behind[-1] = 1  # one replay counted, but the copy it wrote (copy 1) holds no call
    with pytest.raises(RuntimeError, match=r"Duel words are inconsistent: after 1 replays the LRU shadow's latest "
                                           r"counters \(copy 1\) count 0 calls, the other copy 0; SlotPool.invalidate"):
        ft_ops.dedup_and_admit(*pool.state, 0, ids, 1.0, 0, 0, None, DUEL, policy_state=behind, shadows=shadows)
    assert int(pool.clock) == 0, "a rejected call must not advance the clock"
    assert int(shadows[3]) == 0 and int(duel[-21]) == 0, "nor replay it in the shadows"
    with pytest.raises(ValueError, match=r"unknown eviction policy 'lfu'; expected one of \['duel', 'hitdensity', 'lru', 'opportunity'\]"):
        policy_id("lfu")
    with pytest.raises(ValueError, match=r"unknown eviction policy \['lru'\]; expected one of"):
        policy_id(["lru"])  # unhashable: a TypeError before


def test_layer_out_of_range(pool):
    with pytest.raises(RuntimeError, match=r"layer 2 is out of range \[0, 2\)"):
        ft_ops.dedup_and_admit(*pool.state, 2, torch.tensor([1]))
    with pytest.raises(RuntimeError, match=r"layer -1 is out of range"):
        ft_ops.async_layer_copy(*pool.state, pool.banks, pool.host_rows(0), -1, 0, True)


def test_wrong_dtypes(pool):
    with pytest.raises(RuntimeError, match="expert_ids must be int32 or int64, got Float"):
        ft_ops.dedup_and_admit(*pool.state, 0, torch.tensor([1.0]))
    with pytest.raises(RuntimeError, match="slot_of must be Int, got Long"):
        ft_ops.dedup_and_admit(pool.slot_of.long(), *pool.state[1:], 0, torch.tensor([1]))
    with pytest.raises(RuntimeError, match="last_use must be Long"):
        ft_ops.dedup_and_admit(pool.slot_of, pool.owner_of, pool.last_use.int(), pool.clock, 0, torch.tensor([1]))


def test_bad_stats_tensor(pool):
    with pytest.raises(RuntimeError, match="stats must be Long"):
        ft_ops.dedup_and_admit(*pool.state, 0, torch.tensor([1]), 1.0, 0, 0, torch.zeros(5))
    with pytest.raises(RuntimeError, match="at least 4 counters"):
        ft_ops.dedup_and_admit(*pool.state, 0, torch.tensor([1]), 1.0, 0, 0, torch.zeros(3, dtype=torch.int64))
    with pytest.raises(RuntimeError, match=r"stats must be contiguous .*, got strides \[2\]"):
        ft_ops.dedup_and_admit(*pool.state, 0, torch.tensor([1]), 1.0, 0, 0, torch.zeros(8, dtype=torch.int64)[::2])


def test_mismatched_state_shapes(pool):
    with pytest.raises(RuntimeError, match="last_use must have the shape of owner_of"):
        ft_ops.dedup_and_admit(pool.slot_of, pool.owner_of, pool.last_use[:4], pool.clock, 0, torch.tensor([1]))


def test_bad_fraction_and_protect_range(pool):
    with pytest.raises(RuntimeError, match=r"fetch_fraction must be in \[0, 1\], got 1.5"):
        ft_ops.dedup_and_admit(*pool.state, 0, torch.tensor([1]), 1.5)
    with pytest.raises(RuntimeError, match=r"protect range \[4, 20\)"):
        ft_ops.dedup_and_admit(*pool.state, 0, torch.tensor([1]), 1.0, 4, 20)


def test_buffer_region_outside_the_pool(pool):
    with pytest.raises(RuntimeError, match=r"buffer region of 8 slots from first_slot 10 is outside the pool of 16 slots; "
                                             r"first_slot must be in \[0, 8\]"):
        ft_ops.async_layer_copy(*pool.state, pool.banks, pool.host_rows(0), 0, 10, True)


def test_banks_of_different_slot_counts(pool):
    banks = [pool.banks[0], pool.banks[1][:12]]
    with pytest.raises(RuntimeError, match=r"banks\[1\] has 12 slots but banks\[0\] has 16"):
        ft_ops.async_layer_copy(*pool.state, banks, pool.host_rows(0), 0, 0, True)


def test_bank_and_host_row_mismatch(pool):
    with pytest.raises(RuntimeError, match=r"got 2 banks but 1 host_rows"):
        ft_ops.async_layer_copy(*pool.state, pool.banks, pool.host_rows(0)[:1], 0, 0, True)
    host = [pool.host[0][0], pool.host[1][0].double()]
    with pytest.raises(RuntimeError, match=r"banks\[1\] is Float but host_rows\[1\] is Double"):
        ft_ops.async_layer_copy(*pool.state, pool.banks, host, 0, 0, True)
    with pytest.raises(RuntimeError, match=r"host_rows\[0\] has 3 rows but the pool has 8 experts"):
        ft_ops.async_layer_copy(*pool.state, pool.banks, [pool.host[0][0, :3], pool.host[1][0]], 0, 0, True)


def test_copy_plan_out_of_range(pool):
    e = torch.tensor([9], dtype=torch.int32)
    s = torch.tensor([0], dtype=torch.int32)
    n = torch.tensor([1], dtype=torch.int32)
    with pytest.raises(RuntimeError, match=r"copy_experts\[0\] is 9, outside \[0, 8\)"):
        ft_ops.copy_experts(pool.banks, pool.host_rows(0), e, s, n)
    with pytest.raises(RuntimeError, match=r"num_copies is 2 but the plan holds 1"):
        ft_ops.copy_experts(pool.banks, pool.host_rows(0), s, s, n + 1)


def test_expert_gemm_errors():
    prob = random_problem(3, 2, 6, 16, 8, torch.float32, "cpu", False, seed_of("errors"))
    with pytest.raises(RuntimeError, match=r"slot_ids\[1, 0\] is 6, outside \[-1, 6\)"):
        bad = prob["slot_ids"].clone()
        bad[1, 0] = 6
        ft_ops.expert_gemm(**{**prob, "slot_ids": bad})
    with pytest.raises(RuntimeError, match="w13 and w2 must be Float like hidden, got BFloat16"):
        ft_ops.expert_gemm(**{**prob, "w13": prob["w13"].bfloat16()})
    with pytest.raises(RuntimeError, match=r"w2 must be \[6, 16, 8\]"):
        ft_ops.expert_gemm(**{**prob, "w2": prob["w2"][:, :, :4]})
    with pytest.raises(ValueError, match="unknown activation 'tanh'; pass an ft_ops.activations.Activation"):
        ft_ops.expert_gemm(**prob, activation="tanh")
    op, args = torch.ops.freetoken.expert_gemm.default, tuple(prob.values())
    with pytest.raises(RuntimeError, match="unknown activation 'tanh'; expected one of 'silu', 'gelu_tanh', 'gelu', 'relu'"):
        op(*args, "tanh")
    with pytest.raises(RuntimeError, match="'swigluoai' is a preset, not a kind: pass activation='silu', alpha=1.702"):
        op(*args, "swigluoai")
    with pytest.raises(RuntimeError, match="limit must be >= 0"):
        op(*args, "silu", limit=-1.0)
    with pytest.raises(RuntimeError, match="softcaps must be >= 0"):
        op(*args, "silu", up_softcap=-2.0)
    with pytest.raises(RuntimeError, match="limit_after_act clamps the activated gate at limit, so it needs a limit > 0"):
        op(*args, "silu", limit_after_act=True)
    with pytest.raises(RuntimeError, match="kind 'gelu_tanh' needs alpha=1, got 1.702"):
        op(*args, "gelu_tanh", 1.702)
    with pytest.raises(RuntimeError, match="must be finite"):
        op(*args, "silu", gate_softcap=float("inf"))
    with pytest.raises(RuntimeError, match="hidden must be float32, bfloat16 or float16, got Double"):
        ft_ops.expert_gemm(**{**prob, "hidden": prob["hidden"].double()})


def test_activation_values_are_checked_where_they_are_written():
    from ft_ops.activations import SWIGLUOAI, Activation, as_activation

    with pytest.raises(ValueError, match="unknown activation kind 'tanh'; expected one of"):
        Activation("tanh")
    with pytest.raises(ValueError, match="gated must be a bool, got 0"):
        Activation("relu", gated=0)
    with pytest.raises(ValueError, match="alpha scales the sigmoid of kind 'silu' only"):
        Activation("gelu", alpha=1.702)
    with pytest.raises(ValueError, match="limit and softcaps must be >= 0"):
        Activation("silu", limit=-7.0)
    with pytest.raises(ValueError, match="gate_softcap must be a finite number, got nan"):
        Activation("silu", gate_softcap=float("nan"))
    for value in (1e-46, 1e39):  # float32 would make them 0 (a cap turned off) or infinity
        with pytest.raises(ValueError, match=re.escape(f"gate_softcap={value!r} does not fit float32")):
            Activation("silu", gate_softcap=value)
    assert as_activation("swigluoai") is SWIGLUOAI
    assert SWIGLUOAI.op_args() == ("silu", 1.702, 7.0, 1.0, 0.0, 0.0)
    assert str(SWIGLUOAI) == "silu(alpha=1.702, limit=7, up_offset=1)"
    with pytest.raises(ValueError, match="limit_after_act clamps the activated gate at limit, so it needs a limit > 0"):
        Activation("silu", limit_after_act=True)
    with pytest.raises(ValueError, match="limit_after_act must be a bool, got 1"):
        Activation("silu", limit=7.0, limit_after_act=1)
    assert str(Activation("silu", limit=7.0, limit_after_act=True)) == "silu(limit=7, limit_after_act)"


def test_slot_pool_above_the_admission_bound_is_refused_before_allocating():
    from ft_ops.slot_pool import ExpertShape, SlotPool

    shape = ExpertShape(1, 4, 4096, 4096, torch.float32, False)  # 2^24 such slots would be 3 PiB
    with pytest.raises(ValueError, match="more than dedup_and_admit serves"):
        SlotPool(shape, ft_ops.LIMITS["max_slots"] + 1, "cpu")


def test_a_huge_first_slot_is_refused_not_overflowed(pool):
    with pytest.raises(RuntimeError, match=r"first_slot must be in \[0, 8\]"):
        ft_ops.async_layer_copy(*pool.state, pool.banks, pool.host_rows(0), 0, 2**63 - 2, False)


@pytest.mark.parametrize("corrupt", ["slot_of", "owner_of"])
def test_corrupt_pool_maps_are_refused_before_any_write(pool, corrupt):
    """Map entries the kernels index the pool with are checked first (they wrote outside the pool:
    a segfault, or silent heap corruption)."""
    if corrupt == "slot_of":
        pool.slot_of[0, 1] = 2**31 - 1
    else:
        pool.owner_of[3] = 10**9
    before = [t.clone() for t in pool.state]
    with pytest.raises(RuntimeError, match=f"{corrupt}\\[.*outside \\[-1, .*the pool state is corrupt"):
        ft_ops.dedup_and_admit(*pool.state, 0, torch.tensor([1]))
    with pytest.raises(RuntimeError, match="the pool state is corrupt"):
        ft_ops.async_layer_copy(*pool.state, pool.banks, pool.host_rows(0), 0, 0, True)
    assert all(torch.equal(a, b) for a, b in zip(pool.state, before)), "nothing written, the clock included"


def test_meta_tensors_mixed_with_real_ones_are_refused(pool):
    """The dispatcher sends such a call to the fake kernel, which returned uninitialized memory."""
    with pytest.raises(RuntimeError, match="slot_lookup: some tensors are on meta and some on cpu"):
        ft_ops.slot_lookup(pool.slot_of.to("meta"), 0, torch.tensor([0]))
    with pytest.raises(RuntimeError, match="expert_gemm: some tensors are on meta and some on cpu"):
        ft_ops.expert_gemm(torch.zeros(1, 16), torch.zeros(1, 2, dtype=torch.int32), torch.ones(1, 2),
                           torch.zeros(4, 8, 16, device="meta"), torch.zeros(4, 16, 4))
    assert ft_ops.slot_lookup(pool.slot_of.to("meta"), 0, torch.tensor([0], device="meta")).is_meta


def test_negative_copy_plan_entries_are_skipped(pool):
    """As docs/ops.md says and the CUDA kernel does (the CPU kernel raised)."""
    before = [b.clone() for b in pool.banks]
    e = torch.tensor([-1, 2], dtype=torch.int32)
    s = torch.tensor([0, -1], dtype=torch.int32)
    ft_ops.copy_experts(pool.banks, pool.host_rows(0), e, s, torch.tensor([2], dtype=torch.int32))
    for a, b in zip(pool.banks, before):  # the banks start poisoned with NaN
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


def test_the_runtime_without_transformers_refuses_bad_arguments_in_one_line():
    """docs/usage.md's runtime without transformers: a fractional slot count, CUDA on a torch
    without it, a device string torch does not know, float64 weights and expert ids past the
    layer's are refused when given, by name (they were a torch TypeError, an assertion, torch's
    RuntimeError, a failure at the first call and a slot id or an index error)."""
    from ft_ops.moe import OffloadedExperts, OffloadRuntime
    from ft_ops.slot_pool import HostPool

    L, E, H, I = 2, 8, 16, 8
    gen = torch.Generator().manual_seed(0)
    w13, w2 = torch.randn(L, E, 2 * I, H, generator=gen), torch.randn(L, E, H, I, generator=gen)
    for slots in (2.5, True):
        with pytest.raises(TypeError, match="slots must be a whole number of expert slots"):
            OffloadRuntime(HostPool(w13, w2), slots=slots, device="cpu", activation="silu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="device cuda: this torch .* has no usable CUDA"):
            OffloadRuntime(HostPool(w13, w2), slots=20, device="cuda", activation="silu")
    for bad in ("gpu0", 1.5):
        with pytest.raises(ValueError, match=rf"device {bad!r} is not a device torch knows; use 'cpu', 'cuda'"):
            OffloadRuntime(HostPool(w13, w2), slots=20, device=bad, activation="silu")
    with pytest.raises(ValueError, match="expert weights are torch.float64; the pools hold float32"):
        HostPool(w13.double(), w2.double())
    require("cpu", "expert_gemm")
    experts = OffloadedExperts(OffloadRuntime(HostPool(w13, w2), slots=20, device="cpu", activation="silu"), 0)
    # Streamed as a whole layer (expert ids become the region's slots there); an admitted call's op
    # names its expert_ids itself.
    for tokens, error in ((40, ValueError), (3, RuntimeError)):
        for bad in (11, -1):
            with pytest.raises(error, match=rf"{bad}, outside \[0, 8\)"):
                experts(torch.randn(tokens, H, generator=gen), torch.full((tokens, 2), bad),
                        torch.rand(tokens, 2, generator=gen))


def test_empty_sizes_and_shapeless_tensors_are_named(pool):
    """From a stranger's check of docs/ops.md: an expert_gemm of hidden or intermediate size 0 (it was
    "rows must be contiguous"), 0-dim host rows (a raw "Dimension specified as 0"), a layer copy into a
    pool smaller than one layer (an empty first_slot range "[0, -4]"), a non-contiguous bank (which of
    the two was not said)."""
    prob = random_problem(3, 2, 6, 16, 8, torch.float32, "cpu", False, seed_of("errors"))
    with pytest.raises(RuntimeError, match=r"expert_gemm needs hidden and intermediate sizes of at least 1, got 16 and 0"):
        ft_ops.expert_gemm(**{**prob, "w13": prob["w13"][:, :0], "w2": prob["w2"][:, :, :0]})
    one = torch.tensor([0], dtype=torch.int32)
    with pytest.raises(RuntimeError, match=r"host_rows\[0\] has shape \[\]; host rows are \[experts, \.\.\.\]"):
        ft_ops.copy_experts([torch.zeros(())], [torch.zeros(())], one, one, torch.tensor([1], dtype=torch.int32))
    small = make_pool(2, 8, 4, "cpu")
    with pytest.raises(RuntimeError, match=r"the pool holds 4 slots, fewer than one layer's 8 experts"):
        ft_ops.async_layer_copy(*small.state, small.banks, small.host_rows(0), 0, 0, True)
    banks = [pool.banks[0].transpose(1, 2), pool.banks[1]]  # [S, rows, cols] banks: one transposed
    host = [pool.host[0][0].transpose(1, 2), pool.host[1][0]]
    with pytest.raises(RuntimeError, match=r"banks\[0\] must be contiguous \(strides"):
        ft_ops.copy_experts(banks, host, one, one, torch.tensor([1], dtype=torch.int32))
