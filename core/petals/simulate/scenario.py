"""A scenario: the swarm's hardware (a GPU mix), where servers and clients are (regions and their
round trips), how servers come and go (churn, crashes) and what clients do (inference sessions).

``load_scenario`` reads a YAML file whose keys override the defaults (unknown keys are an error).

A scenario may list its servers (``server_list``: each one's GPU kind and region, in join order)
instead of drawing ``servers`` of them from the shares; ``client_region`` puts every client in one
region. ``scenarios/*.yml`` next to this module are ready-made scenarios (``scenario_path(name)``).

A GPU kind's capacities (``max_blocks``, ``cache_sessions``) are typed, or, for a scenario that names its
``model``, planned from the kind's ``memory_gib`` (``petals.simulate.capacity``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from petals.policies.routing import HOP_OVERHEAD


@dataclass(frozen=True, kw_only=True)
class GpuKind:
    """A kind of server: its share of the swarm and what it does for one block of the model.

    Its capacities are typed by hand (``max_blocks``, ``cache_sessions``), or planned for the scenario's
    ``model`` from ``memory_gib`` by the plan ``petals serve`` chooses its blocks with
    (``petals.simulate.capacity``); with a model, a kind that gives its memory is planned.
    """

    name: str
    share: float
    forward_rps: float  # tokens per second through one block, in batches (prefill)
    inference_rps: float  # single-token steps per second through one block
    max_blocks: int | None = None  # blocks its memory holds
    cache_sessions: int | None = None  # sessions of ``session_tokens_max`` tokens its KV cache holds
    memory_gib: float | None = None  # its GPU's memory, to plan the two above from for ``model``
    planned_for: str | None = None  # the model the two above were planned for (None: typed)

    @property
    def sized(self) -> bool:
        """Whether its capacities are known (typed, or planned already)."""
        return self.max_blocks is not None and self.cache_sessions is not None


@dataclass(frozen=True)
class Region:
    name: str
    server_share: float
    client_share: float


@dataclass(frozen=True)
class ServerSpec:
    """One server of an explicit ``server_list``: the names of its GPU kind and of its region."""

    gpu: str
    region: str


# capacities typed for the default 80-block model (a 70B dense model); with a model, planned from memory_gib
DEFAULT_GPUS = tuple(
    GpuKind(
        name=name,
        share=share,
        max_blocks=max_blocks,
        forward_rps=forward_rps,
        inference_rps=inference_rps,
        cache_sessions=cache_sessions,
        memory_gib=memory_gib,
    )
    for name, share, max_blocks, forward_rps, inference_rps, cache_sessions, memory_gib in (
        ("a100-80gb", 0.10, 40, 4000.0, 700.0, 8, 80),
        ("a6000-48gb", 0.15, 24, 2500.0, 450.0, 6, 48),
        ("rtx4090-24gb", 0.30, 12, 2000.0, 500.0, 4, 24),
        ("rtx3090-24gb", 0.25, 12, 1200.0, 350.0, 4, 24),
        ("t4-16gb", 0.20, 6, 300.0, 120.0, 2, 16),
    )
)
DEFAULT_REGIONS = (
    Region("us-east", 0.30, 0.30),
    Region("us-west", 0.20, 0.20),
    Region("europe", 0.30, 0.30),
    Region("asia", 0.15, 0.15),
    Region("south-america", 0.05, 0.05),
)
# round trips in milliseconds, in the order of DEFAULT_REGIONS
DEFAULT_RTT_MS = (
    (8, 65, 80, 180, 120),
    (65, 8, 140, 120, 170),
    (80, 140, 8, 230, 200),
    (180, 120, 230, 8, 300),
    (120, 170, 200, 300, 8),
)


@dataclass(frozen=True)
class Scenario:
    servers: int = 1000
    blocks: int = 80
    hours: float = 24.0
    seed: int = 0
    churn: float = 0.5  # departures per server-hour (each replaced by a new server)
    clients: int = 200
    crash_fraction: float = 0.3  # departures that are crashes: no OFFLINE, the record lingers
    record_lingers: float = 120.0  # seconds a crashed server's records stay in the DHT
    rejoin_seconds: float = 600.0  # mean delay before a departed server's replacement joins
    startup_seconds: float = 30.0  # a server's start before it loads blocks
    load_seconds_per_block: float = 3.0
    ramp_seconds: float = 600.0  # the initial servers join over this time
    warmup_hours: float = 1.0  # not counted in the metrics (at most a quarter of ``hours``)
    session_tokens_min: int = 128
    session_tokens_max: int = 2048
    think_seconds: float = 300.0  # a client's mean pause between sessions
    batch_penalty: float = 0.3  # each further session on a server adds this to its step time
    failover_seconds: float = 5.0  # a session's cost of finding out that its server is gone
    ban_seconds: float = 15.0
    sample_seconds: float = 60.0
    server_rtt_jitter_ms: float = 10.0  # added to each server's round trips (its own link)
    hop_overhead_ms: float = HOP_OVERHEAD * 1000  # per server a token crosses, beyond compute and network
    gpus: tuple[GpuKind, ...] = DEFAULT_GPUS
    regions: tuple[Region, ...] = DEFAULT_REGIONS
    rtt_ms: tuple[tuple[float, ...], ...] = DEFAULT_RTT_MS
    policy_options: dict = field(default_factory=dict)
    server_list: tuple[ServerSpec, ...] = ()  # servers joining in this order; ``servers`` is its length
    client_region: str | None = None  # every client's region (None: drawn from the client shares)
    model: str | None = None  # plan ``blocks`` and the capacities of the GPU kinds with memory_gib for it

    def __post_init__(self) -> None:
        problems = []
        if self.server_list:
            object.__setattr__(self, "servers", len(self.server_list))
        gpu_names, region_names = {gpu.name for gpu in self.gpus}, {region.name for region in self.regions}
        for spec in self.server_list:
            if spec.gpu not in gpu_names or spec.region not in region_names:
                problems.append(
                    f"server_list entry {spec}: gpu must be one of {sorted(gpu_names)} "
                    f"and region one of {sorted(region_names)}"
                )
        if self.client_region is not None and self.client_region not in region_names:
            problems.append(f"client_region {self.client_region!r} is not one of {sorted(region_names)}")
        if self.servers < 1 or self.blocks < 1 or self.hours <= 0:
            problems.append("servers and blocks must be >= 1 and hours > 0")
        if self.warmup_hours < 0:
            problems.append("warmup_hours must be >= 0")
        if len(self.rtt_ms) != len(self.regions) or any(len(row) != len(self.regions) for row in self.rtt_ms):
            problems.append(
                f"rtt_ms must be a {len(self.regions)}x{len(self.regions)} matrix (one row per region)"
            )
        if not self.gpus or sum(gpu.share for gpu in self.gpus) <= 0:
            problems.append("gpus must list at least one kind with a positive share")
        problems += [
            self._unsized(gpu)
            for gpu in self.gpus
            if not gpu.sized and (gpu.memory_gib is None or self.model is None)
        ]
        if not 1 <= self.session_tokens_min <= self.session_tokens_max:
            problems.append("need 1 <= session_tokens_min <= session_tokens_max")
        if problems:
            raise ValueError("invalid scenario: " + "; ".join(problems))

    def _unsized(self, gpu: GpuKind) -> str:
        if gpu.memory_gib is None:
            return (
                f"gpu kind {gpu.name!r} needs max_blocks and cache_sessions, or memory_gib to plan them "
                "for a model (--model)"
            )
        return f"gpu kind {gpu.name!r} gives memory_gib only: name a model (--model) to plan its capacities"

    @property
    def server_kinds(self) -> list[tuple[int, int]]:
        """(GPU kind index, region index) of each listed server, in join order."""
        gpus = [gpu.name for gpu in self.gpus]
        regions = [region.name for region in self.regions]
        return [(gpus.index(spec.gpu), regions.index(spec.region)) for spec in self.server_list]

    @property
    def warmup_seconds(self) -> float:
        return min(self.warmup_hours, self.hours / 4) * 3600

    def replace(self, **changes) -> Scenario:
        return dataclasses.replace(
            self, **{key: value for key, value in changes.items() if value is not None}
        )


def load_scenario(path: str | Path, **overrides) -> Scenario:
    """A scenario from a YAML file (its keys override the defaults), then ``overrides`` (None: keep)."""
    data = yaml.safe_load(Path(path).read_text()) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping of scenario keys, got {type(data).__name__}")
    known = {f.name for f in dataclasses.fields(Scenario)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"{path}: unknown scenario keys {unknown}; known: {sorted(known)}")
    if "gpus" in data:
        data["gpus"] = tuple(GpuKind(**gpu) for gpu in data["gpus"])
    if "regions" in data:
        data["regions"] = tuple(Region(**region) for region in data["regions"])
    if "rtt_ms" in data:
        data["rtt_ms"] = tuple(tuple(row) for row in data["rtt_ms"])
    if "server_list" in data:
        data["server_list"] = tuple(ServerSpec(**spec) for spec in data["server_list"])
        if overrides.get("servers") is not None:
            raise ValueError(f"{path}: lists its servers (server_list); leave out the number of servers")
    # overrides join before the checks: a --model plans kinds that give only their memory
    return Scenario(**{**data, **{key: value for key, value in overrides.items() if value is not None}})


def scenario_path(name: str) -> Path:
    """The ready-made scenario ``scenarios/<name>.yml``."""
    path = Path(__file__).parent / "scenarios" / f"{name}.yml"
    if not path.is_file():
        raise ValueError(f"no scenario named {name!r} in {path.parent}")
    return path
