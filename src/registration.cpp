// The freetoken operator library: every kernel op's schema, in one place. The kernels register
// themselves per device in src/cpu/*.cpp and src/cuda/*.cu; docs/ops.md gives each op's full
// contract. (freetoken::refuse_gradient, the backward of the ops' autograd registration, is defined
// with that registration in ft_ops/ops.py.)
#include <torch/library.h>

TORCH_LIBRARY(freetoken, m) {
  // Slot per routed position (int32, shape of expert_ids); -1 where (layer, expert) is not resident.
  m.def("slot_lookup(Tensor slot_of, int layer, Tensor expert_ids) -> Tensor");

  // Decode admission: dedup routed ids, refresh hits, give victims (by the eviction `policy`:
  // 0 LRU, 1 opportunity, 2 hit density with its `policy_state`, 3 Duel with its own;
  // ft_ops/policies.py) to (a fraction of) the misses, rewrite slot_of/owner_of, emit the copy
  // plan, add the call to `stats` if given. With cpu_expert_cost > 0 the misses admitted are
  // chosen per call from the CPU's costs in units of one expert's copy (src/common/admitted_count.h);
  // the rest stay -1 for the CPU share. Under Duel, `shadows` (its shadow caches' maps,
  // src/common/checks.h) replay the call after it, counted in the Duel words (on CUDA in the same launch).
  m.def(
      "dedup_and_admit(Tensor(a!) slot_of, Tensor(b!) owner_of, Tensor(c!) last_use, "
      "Tensor(d!) clock, int layer, Tensor expert_ids, float fetch_fraction, int protect_lo, "
      "int protect_hi, Tensor(e!)? stats=None, int policy=0, float cpu_expert_cost=0.0, "
      "float cpu_call_cost=0.0, Tensor(f!)? policy_state=None, Tensor(g!)[]? shadows=None) -> (Tensor slot_ids, "
      "Tensor copy_experts, Tensor copy_slots, Tensor num_copies)");

  // Executes a copy plan: banks[j][copy_slots[i]] = host_rows[j][copy_experts[i]] for i < num_copies.
  m.def(
      "copy_experts(Tensor(a!)[] banks, Tensor[] host_rows, Tensor copy_experts, "
      "Tensor copy_slots, Tensor num_copies) -> ()");

  // Prefill streaming: puts the row of every expert e of `layer` in slot first_slot + e (from the
  // host, or with skip_resident from where it is resident, which stays registered unless inside
  // [reclaim_lo, reclaim_hi)); returns the rows read from the host pool.
  m.def(
      "async_layer_copy(Tensor(a!) slot_of, Tensor(b!) owner_of, Tensor(c!) last_use, "
      "Tensor(d!) clock, Tensor(e!)[] banks, Tensor[] host_rows, int layer, int first_slot, "
      "bool skip_resident, int reclaim_lo=0, int reclaim_hi=0, int policy=0, "
      "Tensor? row_sources=None) -> Tensor");

  // out[t] = sum_k weights[t,k] * FFN(slot_ids[t,k], hidden[t]); slots < 0 contribute nothing.
  // The expert function is a kind ('silu', 'gelu_tanh', 'gelu') and its parameters (the clamp
  // limit, the offset of up, the softcaps of gate and up; 0 turns limit and caps off; with
  // limit_after_act the gate's clamp applies to the activated gate instead; gated=False: w13 holds
  // the up rows alone, [slots, I, hidden], and the up values are the gate too), so every
  // transformers family is one set of values rather than one name (src/common/checks.h). With
  // w13_scale and w2_scale, w13 and w2 are FP8 (float8_e4m3fn, 128 x 128 scale_inv blocks, gate and
  // up blocked on their own, or one scale a row; src/common/fp8_format.h) or MXFP4 (uint8 pairs of e2m1
  // values with e8m0 scales per 32; src/common/mxfp4_format.h), dequantized in registers. With
  // slot_map [E], slot_ids are expert ids, expert e in slot slot_map[e] (-1: not in the bank; ids
  // outside [0, E) are not computed): a layer's call, which on CUDA lets a prompt-sized call on a
  // quantized bank dequantize the map's experts a window at a time for the grouped GEMM.
  m.def(
      "expert_gemm(Tensor hidden, Tensor slot_ids, Tensor weights, Tensor w13, Tensor w2, "
      "Tensor? b13, Tensor? b2, str activation, float alpha=1.0, float limit=0.0, "
      "float up_offset=0.0, float gate_softcap=0.0, float up_softcap=0.0, Tensor? w13_scale=None, "
      "Tensor? w2_scale=None, bool limit_after_act=False, bool gated=True, Tensor? slot_map=None) -> Tensor");

  // FP8 or MXFP4 expert rows dequantized: out[i] = weight[slots[i]] times its scales (FP8: 128 x 128
  // scale_inv blocks, or one a row; MXFP4: e8m0 per 32 values), as `dtype` (rows whose slot is -1 are
  // left unwritten). `parts`: projections per weight, each blocked on its own (w13: 2).
  m.def(
      "dequantize_experts(Tensor weight, Tensor scale, Tensor slots, int parts, ScalarType dtype) "
      "-> Tensor");

  // The CPU share of a decode call (src/common/cpu_share.h): submit posts the pairs the admission
  // left at slot -1 (their expert ids, weights and the hidden states) to the session's worker and
  // returns the job's ticket (0: nothing posted); join waits for that job and returns out + its
  // result. No host sync on CUDA, capturable in CUDA graphs. `seq` is the session's job counter;
  // `stats`, the layer's admit counters (ft_ops/stats.py), gets the call's CPU pairs and distinct
  // CPU experts added to its columns 4 and 5.
  m.def(
      "cpu_share_submit(int session, int layer, Tensor hidden, Tensor slot_ids, Tensor expert_ids, "
      "Tensor weights, Tensor(a!) seq, Tensor(b!)? stats=None) -> Tensor");
  m.def("cpu_share_join(int session, Tensor out, Tensor ticket) -> Tensor");
}
