"""Where a profiled training step's time goes, from the Chrome trace ``torch.profiler`` writes: kernel time against step
time, by category (input copy, embedding forward/backward, all-to-all, dense forward/backward, optimizer, metrics, and the
host's share: Python, launches, syncs).

It lives in the train room, beside the recorder (:mod:`recsys_runner.train.profiling`), because every profiled run logs
its table (``profile/breakdown.txt``) and the train room may not import the bench; ``python -m
recsys_runner.bench.breakdown`` is its command line.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

CATEGORIES = ("input_copy", "embedding_fwd", "embedding_bwd", "all_to_all", "dense_fwd", "dense_bwd", "optimizer",
              "metrics", "other")
"""Where kernel (GPU trace) or host (CPU trace) time is attributed; ``metrics`` is everything launched outside the
pipeline's ranges (the train metrics, the lr schedule, the loop's logging), ``other`` what the pipeline's ranges hold
beyond the named phases."""

_GPU_CATS = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})

_RANGE_PHASES = {
    "forward": "fwd", "eval": "fwd", "backward": "bwd", "emb_backward": "bwd", "backward_hook": "bwd",
    "optimizer": "opt", "zero_grad": "opt",
    "copy_batch_to_gpu": "input", "inplace_copy_batch_to_gpu": "input", "next_batch": "input", "load_batch": "input",
    "load": "input", "wait_for_batch": "input",
    "start_sparse_data_dist": "comm", "wait_sparse_data_dist": "comm", "dmp_collection_sync": "comm",
}
"""Phase of TorchRec's pipeline ranges ``## <first word> [batch index] ##`` (the names of torchrec 1.6 and 1.8 alike;
``## load batch N from dataloader (host) ##`` is 1.8's ``TrainPipelineBase``), and of the step policy's
``## backward (step policy) ##``."""

_EMBEDDING_MARKS = ("split_embedding", "embedding_forward", "embedding_backward", "embedding_bag", "splitlookup",
                    "bounds_check", "batch_index_select", "[lookup]_", "tbe_")
"""fbgemm's TBE ops, autograd nodes and kernels, and the sharded module's ``[lookup]_[<fqn>]_[<sharding>]`` range."""

_COMM_MARKS = ("nccl", "gloo:", "c10d::", "record_param_comms", "all_to_all", "alltoall", "all2all", "all_reduce",
               "allreduce", "reduce_scatter", "all_gather", "[splits_dist]", "[tensors_dist]", "[input_dist]",
               "[output_dist")
"""Collectives (nccl kernels, gloo and c10d ops) and the sharded module's input/output distribution ranges."""


@dataclass(frozen=True, slots=True)
class _Context:
    """What the enclosing ranges of an event say: pipeline phase, kind of work, and whether any pipeline range holds it."""

    phase: str | None = None
    kind: str | None = None
    piped: bool = False

    def inside(self, name: str) -> _Context:
        """This context seen from an event ``name`` nested in it: the inner event's marks win."""
        lower = name.lower()
        kind = ("embedding" if any(m in lower for m in _EMBEDDING_MARKS) else
                "comm" if any(m in lower for m in _COMM_MARKS) else
                "optimizer" if "multi_tensor_apply" in lower or "adagrad" in lower else None)
        piped = self.piped
        phase: str | None = None
        if name.startswith("## ") and name.endswith(" ##"):
            piped = True
            words = name[3:-3].split()
            phase = _RANGE_PHASES.get(words[0]) if words else None
        elif name.startswith("autograd::engine::evaluate_function"):
            phase = "bwd"
        elif name.startswith(("Optimizer.step#", "Optimizer.zero_grad#")):
            phase = "opt"
        elif name.startswith("DistributedDataParallel.forward"):
            phase = "fwd"
        elif "memcpy htod" in lower:  # a host-to-device copy kernel, whoever launched it
            phase = "input"
        elif kind == "embedding" and "backward" in lower:  # fbgemm names its backward ops and kernels so
            phase = "bwd"
        return _Context(phase or self.phase, kind or self.kind, piped)

    @property
    def category(self) -> str:
        """The category this context puts time in; a host-to-device copy first, then the kind of work, then the phase."""
        if self.phase == "input":
            return "input_copy"
        if self.kind == "comm" or self.phase == "comm":
            return "all_to_all"
        if self.kind == "embedding":
            return "embedding_bwd" if self.phase == "bwd" else "embedding_fwd"
        if self.phase == "opt" or self.kind == "optimizer":
            return "optimizer"
        if self.phase in ("fwd", "bwd"):
            return "dense_fwd" if self.phase == "fwd" else "dense_bwd"
        return "other" if self.piped else "metrics"


@dataclass(frozen=True)
class StepBreakdown:
    """Per-step averages (ms) of a profiled window: where a step's time goes.

    ``mode="gpu"``: ``busy_ms`` is the union of kernel/memcpy/memset intervals on the GPU streams, ``categories``
    splits it by what launched each kernel (time where kernels of several streams overlap is shared equally among
    them, so the categories sum to ``busy_ms``), ``kernel_categories`` are the plain sums of kernel durations
    (overlapping streams count twice, their total is ``kernel_ms``) and ``host`` is the launching thread's CPU time
    by the same categories. ``mode="cpu"`` (no kernels in the trace): the same categories from the CPU time of the
    main thread, each instant given to the innermost op or range covering it; ``busy_ms`` is the time inside any.
    Either way ``python_host_ms = step_ms - busy_ms``: on a GPU, the time it waits on the host (Python, launches,
    syncs); on a CPU, the loop's own Python outside every op and range.
    """

    mode: str
    steps: int
    step_ms: float
    busy_ms: float
    kernel_ms: float
    categories: dict[str, float]
    kernel_categories: dict[str, float]
    host: dict[str, float]

    @property
    def python_host_ms(self) -> float:
        return self.step_ms - self.busy_ms

    @property
    def step_per_kernel(self) -> float:
        """Step time over busy (kernel) time: 1.0 when the device never waits."""
        return self.step_ms / self.busy_ms if self.busy_ms > 0 else float("inf")

    def as_dict(self) -> dict[str, Any]:
        """The JSON form: every field, the derived ones included."""
        return asdict(self) | {"python_host_ms": self.python_host_ms, "step_per_kernel": self.step_per_kernel}

    def table(self) -> str:
        """A markdown table (category | ms per step | share of step), then kernel time against step time."""
        gpu = self.mode == "gpu"
        busy = "kernel" if gpu else "CPU op"
        head = "| category | ms per step | share of step |" + (" host ms per step |" if gpu else "")
        rows = [f"mode={self.mode} ({'GPU kernel time' if gpu else 'no kernels in the trace: CPU time of the main thread'}), "
                f"{self.steps} steps", "", head, "|---|---:|---:|" + ("---:|" if gpu else "")]
        python_name = "python_host (GPU idle: Python, launches, syncs)" if gpu else "python_host (outside every op)"
        values = [(c, self.categories[c], self.host.get(c, 0.0)) for c in CATEGORIES]
        values.append((python_name, self.python_host_ms, self.host.get("python_host", 0.0)))
        for name, ms, host in values:
            share = ms / self.step_ms if self.step_ms > 0 else 0.0
            rows.append(f"| {name} | {ms:.3f} | {share:.1%} |" + (f" {host:.3f} |" if gpu else ""))
        rows.append(f"| step | {self.step_ms:.3f} | 100.0% |" + (f" {self.step_ms:.3f} |" if gpu else ""))
        summed = f" ({self.kernel_ms:.3f} ms summed over overlapping streams)" if gpu else ""
        rows += ["", f"{busy} time {self.busy_ms:.3f} ms{summed} vs step time {self.step_ms:.3f} ms: "
                     f"step/{busy} = {self.step_per_kernel:.2f}"]
        return "\n".join(rows) + "\n"


@dataclass(slots=True)
class _Node:
    """A CPU-side event in its thread's nesting: its span (clipped to its parent's), its context, whether it lies in a
    profiled step, how much of it its children cover."""

    start: float
    end: float
    context: _Context
    counted: bool
    marker: bool = False
    covered: float = 0.0


def breakdown(trace: Mapping[str, Any], steps: int | None = None) -> StepBreakdown:
    """Where the time of the profiled steps in ``trace`` (what ``export_chrome_trace`` writes) goes, per step.

    Steps are the spans of the ``ProfilerStep#N`` markers (the last ``steps`` of them when given); without markers,
    the whole trace divided by ``steps`` (default 1). A kernel is attributed through its CPU launch (linked by
    ``args.correlation``) to the innermost of the launching thread's ranges and ops that say what it is (TorchRec's
    pipeline ranges ``## forward N ##``, ``## backward N ##``, ``## optimizer N ##``, ``## copy_batch_to_gpu N ##``...,
    the autograd engine's nodes, whose thread launches the backward on a GPU, torch's ``Optimizer.step#``) and to its
    own name (fbgemm's TBE kernels, nccl, host-to-device copies). See :class:`StepBreakdown` for the two modes.
    """
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e and "ts" in e]
    kernels = [e for e in events if e.get("cat") in _GPU_CATS]
    threads: dict[tuple[Any, Any], list[dict[str, Any]]] = {}
    for e in events:
        if e.get("cat") not in _GPU_CATS and e.get("cat") != "gpu_user_annotation":
            threads.setdefault((e.get("pid"), e.get("tid")), []).append(e)
    markers = sorted((e for t in threads.values() for e in t if str(e.get("name", "")).startswith("ProfilerStep#")),
                     key=lambda e: float(e["ts"]))
    if markers and steps is not None:
        markers = markers[-steps:]
    if markers:
        windows = [(float(m["ts"]), float(m["ts"]) + float(m["dur"])) for m in markers]
        main = {(m.get("pid"), m.get("tid")) for m in markers}
    elif events:  # no step markers: the whole trace, the busiest CPU thread as the main one
        windows = [(min(float(e["ts"]) for e in events), max(float(e["ts"]) + float(e["dur"]) for e in events))]
        main = {max(threads, key=lambda k: len(threads[k]))} if threads else set()
    else:
        windows, main = [], set()
    num_steps = len(markers) if markers else (steps or 1)
    per_step = 1000.0 * num_steps  # trace times are in µs
    step_us = sum(b - a for a, b in windows)

    launches: dict[Any, _Context] = {}
    host = dict.fromkeys(CATEGORIES, 0.0)
    chosen = {id(m) for m in markers}
    for key, thread in threads.items():
        _walk(thread, chosen, None if markers else windows[0], launches, host if key in main else None)
    host_ms = {c: v / per_step for c, v in host.items()} | {"python_host": (step_us - sum(host.values())) / per_step}
    if not kernels:
        cpu = {c: host_ms[c] for c in CATEGORIES}
        busy = sum(cpu.values())
        return StepBreakdown("cpu", num_steps, step_us / per_step, busy, busy, cpu, dict(cpu), host_ms)

    spans: list[tuple[float, float, str]] = []
    for k in kernels:  # a kernel whose launch the trace lacks is "other"
        context = launches.get((k.get("args") or {}).get("correlation"), _Context(piped=True))
        category = context.inside(str(k.get("name", ""))).category
        start, end = float(k["ts"]), float(k["ts"]) + float(k["dur"])
        spans += [(max(start, a), min(end, b), category) for a, b in windows if start < b and end > a]
    shared, union = _share_overlaps(spans)
    raw = dict.fromkeys(CATEGORIES, 0.0)
    for start, end, category in spans:
        raw[category] += end - start
    return StepBreakdown("gpu", num_steps, step_us / per_step, union / per_step, sum(raw.values()) / per_step,
                         {c: shared[c] / per_step for c in CATEGORIES}, {c: raw[c] / per_step for c in CATEGORIES}, host_ms)


def _walk(thread: list[dict[str, Any]], markers: set[int], window: tuple[float, float] | None,
          launches: dict[Any, _Context], host: dict[str, float] | None) -> None:
    """Nest one thread's events; note each launch's context under its correlation id and, when ``host`` is given (the
    main thread), add there the self time (what no child covers) of every event inside a chosen step marker (or inside
    ``window`` when the trace has none) by category; a marker's own self time is no category's (it is python_host)."""
    stack: list[_Node] = []
    nodes: list[_Node] = []
    for e in sorted(thread, key=lambda e: (float(e["ts"]), -float(e["dur"]))):
        start, end = float(e["ts"]), float(e["ts"]) + float(e["dur"])
        while stack and stack[-1].end <= start:
            stack.pop()
        parent = stack[-1] if stack else None
        if parent is not None:  # the profiler's rounding can end a child just after its parent: keep the nesting exact
            end = min(end, parent.end)
        if id(e) in markers:
            node = _Node(start, end, _Context(), counted=True, marker=True)
        else:
            outer = parent.context if parent is not None else _Context()
            in_window = window is not None and window[0] <= start < window[1]
            counted = parent.counted if parent is not None else in_window
            node = _Node(start, end, outer.inside(str(e.get("name", ""))), counted)
        if parent is not None:
            parent.covered += end - start
        correlation = (e.get("args") or {}).get("correlation")
        if correlation is not None:
            launches[correlation] = node.context
        stack.append(node)
        nodes.append(node)
    if host is not None:
        for node in nodes:
            if node.counted and not node.marker:
                host[node.context.category] += max(0.0, node.end - node.start - node.covered)


def _share_overlaps(spans: list[tuple[float, float, str]]) -> tuple[dict[str, float], float]:
    """Per category, the time its spans cover, an instant covered by ``k`` spans giving ``1/k`` to each; and the union."""
    edges = sorted([(s, 1, c) for s, e, c in spans if e > s] + [(e, -1, c) for s, e, c in spans if e > s])
    shared = dict.fromkeys(CATEGORIES, 0.0)
    active = dict.fromkeys(CATEGORIES, 0)
    open_spans, union, last = 0, 0.0, 0.0
    for t, delta, category in edges:
        if open_spans:
            length = t - last
            union += length
            for c, n in active.items():
                if n:
                    shared[c] += length * n / open_spans
        active[category] += delta
        open_spans += delta
        last = t
    return shared, union
