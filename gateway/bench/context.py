"""What a scenario is, is given and gives back: the `Scenario` (how it runs and how the report shows
it), the `Plan` (how many of everything; the lab's own scenarios' counts are its `LabPlan`), the
`Context` (client, workload, the loaded trajectories, peer, callbacks) and the `ScenarioResult`.
The scenario modules (the bench's and the lab's) import this one; it imports none of them.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from gateway.bench.client import BenchClient, Expected, Sample
from gateway.bench.trajectories import Trajectories
from gateway.bench.workload import ToolGroup, Workload

if TYPE_CHECKING:  # rich is the bench extra's; only the type is needed here
    from rich.table import Table

Scenarios = dict[str, dict[str, Any]]  # the report's scenarios: name -> its numbers
Floors = Mapping[int, Sequence[float]]  # the model's own suffix prefill (ms) per group size, from the lab's probe


@dataclass(frozen=True, slots=True)
class Plan:
    tools: int = 20  # tools per group (scenarios 1, 3, 4, 5)
    tool_counts: tuple[int, ...] = (5, 10, 20, 50)
    hits_per_count: int = 2
    requests: int = 8  # hits on the main group of scenario 1
    misses: int = 3
    bypass: int = 3
    groups: int = 3
    rounds: int = 3
    clients: tuple[int, ...] = (1, 4, 8)  # one case per count, on one group and on mixed groups
    requests_per_client: int = 2
    mixed_groups: int = 4  # groups the mixed-group cases spread their clients over
    concurrent_max_tokens: int = 32  # long enough answers for output tokens/s to mean something
    compile_tools: int = 20  # the group that compiles during the hits (20 tools: ~3,000 tokens)
    alone_hits: int = 3  # compile-overlap: hits timed with nothing else running
    max_hits_during_compile: int = 50
    soak_requests: int = 1000
    soak_groups: int = 8
    soak_tools: int = 5  # small groups: the soak measures memory over many requests, not prefill
    soak_clients: int = 4
    conversations: int = 1  # agent: tau-bench conversations replayed, in (task, trial) order
    agent_max_tokens: int = 16
    agent_turns: int = 0  # requests the agent scenario sends: its conversations' turns, once loaded
    peer_groups: int = 2  # peer: groups sent cold to both servers, then repeated
    peer_hits: int = 4  # repeats per group, with new questions
    peer_decode_requests: int = 3  # one stream at a time, for decode ms/token
    peer_decode_tokens: int = 64
    peer_clients: tuple[int, ...] = (1, 4, 16, 32)  # streaming clients at once, for aggregate tokens/s

    @classmethod
    def quick(cls, tools: int = 10) -> Plan:
        return cls(tools=tools, tool_counts=(5, 10, 20), hits_per_count=1, requests=3, misses=2, bypass=0,
                   groups=2, rounds=2, clients=(1, 4), requests_per_client=1, mixed_groups=2,
                   concurrent_max_tokens=8, compile_tools=tools, alone_hits=2, soak_requests=100, soak_groups=4,
                   peer_groups=1, peer_hits=2,
                   peer_decode_requests=1, peer_decode_tokens=16, peer_clients=(1, 4))


class Restartable(Protocol):
    async def restart(self) -> str:
        """Stop the server and start it again on the same cache dir; return the new base URL."""


@dataclass(frozen=True, slots=True)
class Peer:
    """The server measured side by side with the main one (`--peer-url`), and the model id to ask
    it for (None: the main server's)."""

    client: BenchClient
    model: str | None


@dataclass(slots=True)
class Context:
    client: BenchClient
    workload: Workload
    plan: Plan
    server: Restartable | None
    on_sample: Callable[[Sample], None]
    on_skip: Callable[[int], None]  # planned requests that will not be sent
    trajectories: Trajectories | None = None  # the agent scenario's conversations
    peer: Peer | None = None  # the peer scenario's other server

    async def send(self, scenario: str, group: ToolGroup, expected: Expected, *, bypass: bool = False,
                   max_tokens: int | None = None, talk: bool = False, on_sent: Callable[[], None] | None = None,
                   **tags: Any) -> Sample:
        sample = Sample(scenario, group.label, group.num_tools, group.offset, expected, bypass, 0.0, tags=tags)
        return await self.send_body(sample, self.workload.body(group, max_tokens, talk=talk), on_sent)

    async def send_body(self, sample: Sample, body: dict[str, Any],
                        on_sent: Callable[[], None] | None = None) -> Sample:
        await self.client.chat(body, sample, on_sent)
        self.on_sample(sample)
        return sample


@dataclass(slots=True)
class ScenarioResult:
    name: str
    samples: list[Sample] = field(default_factory=list)
    skipped: str | None = None  # why the whole scenario did not run
    notes: list[str] = field(default_factory=list)
    details: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Scenario:
    """A scenario: how it runs, the requests it plans (the progress bar), and how the report shows
    it. `stats`: its own numbers (None: p50/p95 per cache class); `in_table`: a row of the main
    table; `table`, `lines` and `plot` read the report's scenarios (called once each, when it ran)."""

    name: str
    run: Callable[[Context], Awaitable[ScenarioResult]]
    planned: Callable[[Plan], int]
    stats: Callable[[ScenarioResult, Floors], dict[str, Any]] | None = None
    in_table: bool = False
    table: Callable[[Scenarios], Table | None] | None = None
    lines: Callable[[Scenarios], list[str]] | None = None
    plot: Callable[[Scenarios, str | None, Path], Path | None] | None = None
