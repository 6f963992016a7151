"""OffloadedExperts, the module that replaces a model's experts block, and OffloadRuntime, the
state every such module of one model shares (host pool, slot pool, the two strategies, counters).

forward(hidden_states [T, H], top_k_index [T, K], top_k_weights [T, K]) -> [T, H], by one of two
strategies chosen once per forward from its shape and the cache's contents: stream the whole layer
(long prompts, copies overlapped with compute) or admit only the routed experts (decode and short
calls).
"""
from typing import Optional, Sequence, Union

import torch

from . import ops
from .activations import SILU, Activation, per_layer
from .admission import ExpertAdmitter, check_fetch_fraction, count_distinct
from .cpu_share import DEFAULT_TOKENS
from .expert_compute import dequantizes_layer, gemm_on_layer
from .formats import COMPUTE_DTYPES, DENSE
from .forward_lock import ForwardLock
from .policies import DEFAULT_EVICTION, policy_name
from .rates import Rates, measure_rates
from .slot_pool import ExpertShape, HostPool, SlotPool
from .stats import Stats
from .streaming import LayerStreamer
from .user_warnings import warn


def check_runtime_options(fetch_fraction, rates, collect_stats: bool = True) -> None:
    """Refuses a fetch_fraction outside [0, 1] (or "auto", which needs the counters) and rates that
    are not Rates: cheap checks, done before any pool is allocated or any rate measured."""
    check_fetch_fraction(fetch_fraction)
    if not isinstance(collect_stats, bool):
        raise TypeError(f"collect_stats must be True or False, got {collect_stats!r}")
    if fetch_fraction == "auto" and not collect_stats:
        raise ValueError("fetch_fraction='auto' weighs each layer's hits per miss from its admission counters: "
                         "keep collect_stats=True")
    if rates is not None and not isinstance(rates, Rates):
        raise TypeError(f"rates must be an ft_ops.rates.Rates(link_bytes_per_s=..., gemm_flops_per_s=...) or None "
                        f"(measured), got {type(rates).__name__}")


def hidden_dtype_problem(shape: ExpertShape, dtype: torch.dtype) -> Optional[str]:
    """Why offloaded experts of `shape` cannot compute on hidden states of `dtype`, or None:
    bf16/float32 experts (and quantized experts' biases) compute in the dtype they were offloaded
    in; quantized experts without biases in the hidden states' dtype, one of COMPUTE_DTYPES."""
    if shape.dtype_fixed:
        if dtype == shape.dtype:
            return None
        what = "experts compute" if shape.format == DENSE else f"{shape.format} experts' biases are"
        return f"the offloaded {what} in {shape.dtype}, the dtype they were offloaded in"
    if dtype in COMPUTE_DTYPES:
        return None
    return f"the offloaded {shape.format} experts compute in the hidden states' dtype, which must be float32, bfloat16 or float16"


class OffloadRuntime:
    """Everything the MoE layers of one model share."""

    def __init__(self, host: HostPool, slots: int, device,
                 activation: Union[Activation, str, Sequence[Union[Activation, str]]] = SILU,
                 fetch_fraction: Union[float, str] = 1.0, rates: Optional[Rates] = None,
                 skip_resident: bool = True, collect_stats: bool = True,
                 stream_prefill: bool = True, eviction: str = DEFAULT_EVICTION, top_k: Optional[int] = None,
                 cpu_share_tokens: int = DEFAULT_TOKENS):
        # Its state (pools, counters, the CPU share's mailbox) is updated in place by every call,
        # under torch.inference_mode() or not: made inside inference mode, it would be inference
        # tensors, which torch lets no call outside inference mode update.
        with torch.inference_mode(False):
            # An Activation or a preset's name for every layer, or one per layer.
            self.activations = per_layer(activation, host.shape.layers)
            for layer, act in enumerate(self.activations):
                if act.gated != host.shape.gated:
                    raise ValueError(f"layer {layer}'s activation {act} is {'gated' if act.gated else 'ungated'} but the "
                                     f"host pool holds {'gated' if host.shape.gated else 'ungated'} experts (w13 of "
                                     f"{(2 if host.shape.gated else 1) * host.shape.intermediate} rows); pass an "
                                     f"activation that matches them")
            check_runtime_options(fetch_fraction, rates, collect_stats)
            self.host = host
            self.shape = host.shape
            # A call admits round(misses x fetch_fraction) of at most E misses: below 0.5 / E none
            # (fetch_fraction 0 above all), so no call takes a victim and Duel keeps no shadows.
            admits = isinstance(fetch_fraction, str) or fetch_fraction * host.shape.experts >= 0.5
            self.pool = SlotPool(host.shape, slots, device, eviction, admits=admits)
            # Streaming needs S >= E (LayerStreamer says so with the smallest working size);
            # stream_prefill=False serves every call by admission, for pools of any size. A pool that
            # holds every expert streams each layer into its own home region (ft_ops/streaming.py).
            self.streamer = LayerStreamer(self.pool, host, skip_resident) if stream_prefill else None
            # The stream-or-admit rule needs this machine's rates: measured on the empty pool unless
            # given (a few milliseconds, once).
            # Where they came from, for stats(): "given", "measured", or "default" (no prefill
            # streaming: nothing uses them, so nothing is measured).
            self.rates_source = "given" if rates is not None else "measured" if self.streamer is not None else "default"
            if rates is None:
                rates = measure_rates(self.pool, host, self.activations[-1]) if self.streamer is not None else Rates()
            self.rates = rates
            # One owner of every counter (None: not counted).
            self.counters = Stats(host.shape.layers, host.shape.experts, self.pool.device) if collect_stats else None
            # top_k (experts routed per token), when known, starts the CPU share's worker now rather
            # than at the first call that leaves it pairs (which must then run eagerly).
            self.admitter = ExpertAdmitter(self.pool, host, self.activations, fetch_fraction, self.counters, top_k,
                                           cpu_share_tokens)
        # Held around each forward by the plugin: one forward at a time through these pools.
        self.forward_lock = ForwardLock()
        self._autocast_noted = False  # the autocast warning, once a runtime
        self._streaming = False
        # The stream-or-admit choice of the forward under way: made at its first MoE layer (or by
        # begin_forward just before it), kept for its other layers.
        self._choice_key = None
        self._choice_stream = False
        self._choice_made_ahead = False

    def expected_unique(self, tokens: int, top_k: int) -> float:
        """Distinct experts a call of `tokens` touches, under uniform routing."""
        E = self.shape.experts
        return E * (1.0 - (1.0 - min(top_k, E) / E) ** tokens)

    def should_stream(self, tokens: int, top_k: int) -> bool:
        """Stream the whole layer when the experts a call leaves untouched cost less to move than
        the compute they would hide behind; otherwise admit only the routed experts (a short turn
        of a few dozen tokens never pays for whole layers). A pass sends only experts that are not
        resident, so the untouched experts' cost is scaled by the share that the last pass found
        missing (LayerStreamer.resident_share: a host value, so deciding never syncs; it lags the
        admissions since that pass, so it errs toward admitting, as without it)."""
        if self.streamer is None:
            return False
        E = self.shape.experts
        if tokens * top_k < E:
            # Fewer routed pairs than experts: at least E - tokens*top_k of the streamed experts
            # are never used. Decided without the rates, so a noisy measurement can never make
            # a decode step stream.
            return False
        untouched = E - self.expected_unique(tokens, top_k)
        missing = 1.0 - self.streamer.resident_share()
        extra_transfer_s = untouched * missing * self.shape.expert_bytes / self.rates.link_bytes_per_s
        compute_s = tokens * top_k * self.shape.flops_per_pair / self.rates.gemm_flops_per_s
        return extra_transfer_s <= compute_s

    @staticmethod
    def _same_call(key, other) -> bool:
        """Whether two (tokens, top_k) keys are calls of one forward: the same routed pairs. The
        families whose experts compute one row per route (a norm of each route's output, Llama 4's
        input-scaled routing) call them as (tokens * top_k, 1) where the model's hook saw
        (tokens, top_k)."""
        return other is not None and key[0] * key[1] == other[0] * other[1]

    def _forward_choice(self, layer: int, key) -> bool:
        """The choice of the forward under way: made at its first MoE layer (unless begin_forward
        made it just before), kept for its other layers (a pass streams every layer or none)."""
        if (layer == 0 and not self._choice_made_ahead) or not self._same_call(key, self._choice_key):
            self._choice_key, self._choice_stream = key, self.should_stream(*key)
        self._choice_made_ahead = False
        return self._choice_stream

    def run_layer(self, layer: int, hidden: torch.Tensor, top_k_index: torch.Tensor,
                  top_k_weights: torch.Tensor) -> torch.Tensor:
        """One MoE layer's experts. In eager mode the call holds the forward lock (re-entrant: the
        plugin's model call and generate hold it for a whole forward), so a call that reached the
        experts without it (a submodule called directly, `model.model(...)`) never runs inside
        another thread's forward, between its admission and its GEMM or inside its streamed
        layer; a pass that another forward closed in between opens again at the next layer."""
        if torch.compiler.is_compiling():  # compiled code takes no lock; generate around it does
            return self._run_layer(layer, hidden, top_k_index, top_k_weights)
        self.forward_lock.acquire()
        try:
            if not self._autocast_noted and torch.is_autocast_enabled(hidden.device.type):
                self._note_autocast()
            return self._run_layer(layer, hidden, top_k_index, top_k_weights)
        finally:
            self.forward_lock.release()

    def _note_autocast(self) -> None:
        """Warns once that torch.autocast does not reach the experts: the rest of the model computes
        in autocast's dtype, so the model's outputs differ from the original's under it."""
        self._autocast_noted = True
        computes = ("the hidden states' dtype" if self.shape.format != DENSE
                    else f"{self.shape.dtype} (the dtype they were offloaded in)")
        warn(f"torch.autocast does not reach the offloaded experts: they compute in {computes}, while the "
             f"rest of the model follows autocast, so the outputs differ from the original model's under it")

    def _run_layer(self, layer: int, hidden: torch.Tensor, top_k_index: torch.Tensor,
                   top_k_weights: torch.Tensor) -> torch.Tensor:
        # Under torch.compile every call admits: the streamer's streams, events and cross-call
        # state cannot live in a (CUDA-graph-captured) graph, while admission is one capturable
        # op chain that still copies only the routed experts (docs/design.md).
        problem = hidden_dtype_problem(self.shape, hidden.dtype)
        if problem:  # (the kernels would refuse it too, naming their weight or bias banks)
            back = (f"cast it back (model.to({self.shape.dtype})), or cast before offloading (weights cast to a "
                    "narrower dtype and back keep its rounding: reload the model for the original's outputs)"
                    if self.shape.dtype_fixed else "cast it to one of those (model.to(torch.bfloat16))")
            raise TypeError(f"{problem}, but the hidden states are {hidden.dtype} (was the model cast after "
                            f"offloading?): {back}")
        if not torch.compiler.is_compiling() and self._forward_choice(layer, tuple(top_k_index.shape)):
            return self._stream(layer, hidden, top_k_index, top_k_weights)
        if self._streaming:
            self._close_pass()
        return self.admitter(layer, hidden, top_k_index, top_k_weights)

    @torch.compiler.disable
    def _close_pass(self) -> None:
        """Queued layer copies go before any admission. Never compiled: a compiled layer that meets
        an open pass (only its layers compiled, a long prompt opened by the hook) breaks its graph
        here, or fails loudly under fullgraph=True, rather than admit beside the copies."""
        self.streamer.finish()
        self._streaming = False

    def _stream(self, layer, hidden, top_k_index, top_k_weights):
        if top_k_index.device.type == "cpu" and top_k_index.numel():
            # The streamed GEMM takes expert ids as slots of the region, so a bad id would be named
            # as a slot (or an index) there; on the host checking is free (on CUDA a sync: there
            # out-of-range ids are not routed). Admission's op checks its ids on the CPU itself.
            low, high = (int(v) for v in torch.aminmax(top_k_index))
            if low < 0 or high >= self.shape.experts:
                raise ValueError(f"top_k_index holds expert id {low if low < 0 else high}, outside "
                                 f"[0, {self.shape.experts}): the layer has {self.shape.experts} experts")
        self._streaming = True
        from_host = self.streamer.acquire(layer, top_k_index)
        out = self._streamed_gemm(layer, hidden, top_k_index, top_k_weights)
        self.streamer.release(layer)
        if self.counters is not None:
            self.counters.add_stream(layer, from_host, top_k_index.numel(),
                                     count_distinct(top_k_index, self.shape.experts))
        if layer == self.shape.layers - 1:
            self.streamer.finish()
            self._streaming = False
        return out

    def _streamed_gemm(self, layer, hidden, top_k_index, top_k_weights):
        if dequantizes_layer(self.pool, hidden.shape[0]):
            # Quantized: the region's experts dequantized into a scratch bank.
            return gemm_on_layer(self.pool, self.streamer.region_slots(layer), hidden, top_k_index, top_k_weights,
                                 self.activations[layer])
        # The region alone as the bank, the expert ids as its slots: E groups for the grouped GEMM
        # whatever the pool's size, and no gather through a slot map.
        w13, w2, b13, b2, s13, s2 = self.streamer.region_banks(layer)
        return ops.expert_gemm(hidden, top_k_index, top_k_weights, w13, w2, b13, b2, self.activations[layer], s13,
                               s2)

    def begin_forward(self, tokens: int, top_k: int) -> None:
        """Called before a model forward of `tokens` tokens (the plugin's hook): a call that will
        stream starts the copies of its first layers now, before the embedding and the first
        attention, so the link works while they compute. Eager mode only."""
        if torch.compiler.is_compiling():
            return
        if (self._choice_made_ahead and self._choice_key == (tokens, top_k) and self._streaming
                and self.streamer.opened_and_unused()):
            return  # generate() opened this prompt's pass already; its prefetch changed the pool since
        self._choice_key, self._choice_stream = (tokens, top_k), self.should_stream(tokens, top_k)
        self._choice_made_ahead = True
        if not self._choice_stream:
            return
        if self._streaming:
            if self.streamer.opened_and_unused():
                return  # opened for this prompt already (the plugin's generate() starts it early)
            self.streamer.finish()  # a pass that an earlier forward left open (it raised part way)
        self._streaming = True
        self.streamer.prefetch()

    def stats(self) -> dict:
        """Counters per strategy ("admit", "stream") summed over layers, with rates, and the pools'
        sizes (reads the device: a host sync). docs/usage.md defines every field."""
        out = self.counters.summary(self.shape.expert_bytes) if self.counters is not None else {}
        split = self.admitter.split
        if split is not None:
            out["cpu_split"] = dict(link_us_per_expert=round(split.link_expert_s * 1e6, 1),
                                    cpu_us_per_expert=round(split.cpu_expert_s * 1e6, 1),
                                    cpu_us_per_call=round(split.cpu_call_s * 1e6, 1))
        group = dict(int4_group=self.shape.group) if self.shape.group else {}  # values per scale
        out["pool"] = dict(format=self.shape.format, **group, slots=self.pool.slots, experts_per_layer=self.shape.experts,
                           layers=self.shape.layers, device_bytes=self.pool.nbytes,
                           host_bytes=self.host.nbytes, expert_bytes=self.shape.expert_bytes,
                           link_GBps=round(self.rates.link_bytes_per_s / 1e9, 2),
                           gemm_TFLOPs=round(self.rates.gemm_flops_per_s / 1e12, 3), rates=self.rates_source,
                           eviction=policy_name(self.pool.policy))
        duel = self.pool.duel_summary()
        if duel is not None:
            out["duel"] = duel
        return out


class OffloadedExperts(torch.nn.Module):
    """Drop-in experts block: forward(hidden_states, top_k_index, top_k_weights)."""

    def __init__(self, runtime: OffloadRuntime, layer: int):
        super().__init__()
        if not 0 <= layer < runtime.shape.layers:
            raise ValueError(f"layer {layer} is out of range for a pool of {runtime.shape.layers} MoE layers")
        self.runtime = runtime
        self.layer = layer

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        if hidden_states.dim() == 2:  # what transformers' MoE blocks pass
            return self.runtime.run_layer(self.layer, hidden_states, top_k_index, top_k_weights)
        shape = hidden_states.shape
        hidden = hidden_states.reshape(-1, shape[-1])
        out = self.runtime.run_layer(self.layer, hidden, top_k_index.reshape(hidden.shape[0], -1),
                                     top_k_weights.reshape(hidden.shape[0], -1))
        return out.reshape(shape)

    def extra_repr(self) -> str:
        return f"layer={self.layer}, slots={self.runtime.pool.slots}, experts={self.runtime.shape.experts}"
