"""What the console says between the run's other lines: the services' start-up and a long step's
progress, at most one line every ``logger.progress_every_s`` and only about work that old."""

from __future__ import annotations

import asyncio

from flowgrpo.runtime.startup import describe_startup, starting_phase, starting_refusal
from flowgrpo.services.coordinator.progress import READY_LINES, StartupReport, StepProgress, duration
from flowgrpo.v1 import common_pb2


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_step_is_described_only_once_it_has_run_every_s() -> None:
    clock = Clock()
    progress = StepProgress(None, every_s=10, clock=clock)
    progress.begin("step3", "step 3/40", samples=768)
    progress.drawn("step3", 512)
    progress.scored("step3", 490)
    clock.now += 9.9
    assert progress.line() is None  # a step shorter than every_s is never described
    clock.now += 0.1
    assert progress.line() == "  step 3/40 (10 s): drawn 512/768, scored 490/768"
    progress.drawn("step3", 256)
    progress.scored("step3", 278)
    progress.scored("step3", -10)  # a reward replica failed: its results are void, scored again
    progress.scored("step3", 10)
    progress.doing("step3", "training")
    progress.begin("step4", "step 4/40", samples=768)  # async: the next step is drawn meanwhile
    clock.now += 95
    assert progress.line() == (
        "  step 3/40 (1:45): drawn 768/768, scored 768/768, training for 1:35; "
        "step 4/40 (1:35): drawn 0/768, scored 0/768"
    )
    progress.end("step3")
    progress.end("step4")
    assert progress.line() is None
    progress.begin("save", "saving the checkpoint of step 4")
    clock.now += 3700
    assert progress.line() == "  saving the checkpoint of step 4 (1:01:40)"
    progress.drawn("nothing", 1)  # work that ended (or never began) is ignored


def test_the_notes_come_at_most_every_every_s_and_never_when_it_is_0() -> None:
    async def notes(every_s: float, run_s: float) -> list[str]:
        said: list[str] = []
        progress = StepProgress(said.append, every_s=every_s)
        progress.begin("step1", "step 1/2", samples=4)
        task = asyncio.create_task(progress.run())
        await asyncio.sleep(run_s)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return said

    async def body() -> None:
        many = await notes(every_s=0.05, run_s=0.33)
        assert 1 <= len(many) <= 6  # at most one per every_s (fewer on a loaded machine)
        assert all(line.startswith("  step 1/2 (0 s): drawn 0/4") for line in many)
        assert await notes(every_s=0.5, run_s=0.33) == []  # a step shorter than every_s: nothing
        assert await notes(every_s=0, run_s=0.1) == []  # 0: off

    asyncio.run(body())


def test_the_start_up_names_who_is_still_starting_and_each_one_when_ready() -> None:
    clock, said = Clock(), []
    report = StartupReport(said.append, every_s=30, clock=clock)
    report.expect(["rollout-0", "trainer"])
    clock.now += 31
    expected = "rollout-0 (starting its process); trainer (starting its process)"
    assert report.line() == f"  still starting after 31 s: {expected}"
    info = common_pb2.ServiceInfo(
        replica_id="rollout-0", startup_s=4.25,
        startup=[common_pb2.StartupPhase(name="imports", seconds=1.1),
                 common_pb2.StartupPhase(name="model", seconds=3.1, detail="native engine on cpu, float32")],
    )  # fmt: skip
    report.ready(info)
    assert said == ["rollout-0 ready in 4.2 s: imports 1.1 s, model 3.1 s (native engine on cpu, float32)"]
    assert report.line() == "  still starting after 31 s: trainer (starting its process)"
    report.ready(common_pb2.ServiceInfo(replica_id="trainer", grpc_address="h:1"))  # a service of old
    assert said[-1] == "trainer ready at h:1" and report.line() is None


def test_many_replicas_are_said_one_by_one_up_to_a_bound_then_in_one_line() -> None:
    async def body() -> list[str]:
        said: list[str] = []
        report = StartupReport(said.append, every_s=30)
        async with report.watching():
            for i in range(READY_LINES + 48):
                report.ready(common_pb2.ServiceInfo(replica_id=f"rollout-{i}", startup_s=1.0 + (i == 40)))
        return said

    said = asyncio.run(body())
    assert said[:READY_LINES] == [f"rollout-{i} ready in 1.0 s" for i in range(READY_LINES)]
    assert said[READY_LINES:] == ["... and 48 more ready; the slowest: rollout-40 ready in 2.0 s"]


def test_a_replica_that_listens_is_asked_at_once_and_named_by_its_address_until_it_answers() -> None:
    async def body() -> None:
        clock, said = Clock(), []
        report = StartupReport(said.append, every_s=30, clock=clock)
        report.expect(["rollout-0", "trainer"])
        async with report.watching():
            report.listening("trainer", "127.0.0.1:9", "trainer", timeout_s=0.3)  # nothing listens there
            await asyncio.sleep(0.05)
            clock.now += 60
            rollout = "rollout-0 (starting its process)"
            assert (
                report.line()
                == f"  still starting after 1:00: {rollout}; trainer at 127.0.0.1:9 (no answer yet)"
            )
            await asyncio.sleep(0.5)
            assert report.line() == f"  still starting after 1:00: {rollout}"  # the trainer: given up
        assert said == []  # the launcher's own wait says why it gave up

    asyncio.run(body())


def test_a_replicas_words_are_quoted_printable_and_bounded() -> None:
    phases = [common_pb2.StartupPhase(name="model\x1b[2J", seconds=1.0, detail="x" * 500)] * 20
    line = describe_startup(common_pb2.ServiceInfo(replica_id="r\n0", startup_s=20.0, startup=phases))
    assert line.isprintable() and line.startswith("r?0 ready in 20.0 s: model?[2J 1.0 s (xxx")
    assert line.count("model") == 8 and len(line) < 8 * 150  # 8 phases, 120 characters of detail each
    refusal = starting_refusal("rollout-0", "model\x07", 3.0)
    assert starting_phase(f"rollout rollout-0: {refusal}") == ("rollout-0", "model? for 3 s")


def test_a_starting_refusal_reads_as_a_sentence() -> None:
    assert starting_refusal("rollout-0", "model", 61.4) == (
        "not ready: rollout-0 is starting (model for 61 s); retry, or wait for its READY handshake"
    )
    assert "(starting up)" in starting_refusal("rollout-0", "", None)
    assert [duration(s) for s in (0.4, 59.9, 60, 3599, 3600, 86_399)] == [
        "0 s", "59 s", "1:00", "59:59", "1:00:00", "23:59:59"
    ]  # fmt: skip
