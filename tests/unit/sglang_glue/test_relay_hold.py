"""The test-only relay hold (sglang_glue/relay/relay_hold.py) on a stand-in scheduler: it pauses at
the first iteration where a running request reached the armed length, once per arming, and
never unless armed."""

from types import SimpleNamespace

from sglang_pdd.launcher.topology import ServerSpec, server_env
from sglang_pdd.sglang_glue.relay.relay_hold import HELD_SUFFIX, RELAY_HOLD_FILE_ENV, RelayHold, arm, reached


class Req:
    def __init__(self, n: int, finished: bool = False):
        self.output_ids, self._finished = list(range(n)), finished

    def finished(self) -> bool:
        return self._finished


def scheduler(*reqs):
    return SimpleNamespace(_engine_paused=False, _pause_started_at=None, running_batch=SimpleNamespace(reqs=list(reqs)))


def test_reached_is_the_first_length_at_or_past_the_armed_one():
    assert reached(3, [1, 2]) is None
    assert reached(3, [1, 3, 5]) == 3
    assert reached(3, []) is None


def test_hold_pauses_once_a_running_request_reaches_the_armed_length(tmp_path):
    path = tmp_path / "hold"
    hold = RelayHold.from_env({RELAY_HOLD_FILE_ENV: str(path)})
    s = scheduler(Req(2), Req(9, finished=True))  # a finished request does not count
    hold.check(s)
    assert not s._engine_paused  # not armed
    path.write_text("3")
    hold.check(s)
    assert not s._engine_paused and path.exists()  # armed, nobody at 3 yet
    s.running_batch.reqs.append(Req(3))
    hold.check(s)
    assert s._engine_paused and s._pause_started_at is not None
    assert not path.exists() and (tmp_path / f"hold{HELD_SUFFIX}").read_text() == "3"


def test_hold_fires_once_per_arming(tmp_path):
    path = tmp_path / "hold"
    hold = RelayHold(str(path))
    path.write_text("2")
    s = scheduler(Req(2))
    hold.check(s)
    s._engine_paused = False  # /continue_generation
    (tmp_path / f"hold{HELD_SUFFIX}").unlink()
    hold.check(s)
    assert not s._engine_paused and not (tmp_path / f"hold{HELD_SUFFIX}").exists()


def test_a_bad_arming_is_dropped_not_fatal(tmp_path):
    path = tmp_path / "hold"
    path.write_text("soon")
    s = scheduler(Req(5))
    RelayHold(str(path)).check(s)
    assert not s._engine_paused and not path.exists()


def test_an_arming_caught_half_written_stays_armed(tmp_path):
    """RLD polls the file every iteration: one that exists but is still empty (created, not yet
    written) was taken for a bad arming and removed, and RLD then never held (a test waited 60 s
    for a hold that could not come)."""
    path = tmp_path / "hold"
    path.write_text("")
    s = scheduler(Req(5))
    hold = RelayHold(str(path))
    hold.check(s)
    assert not s._engine_paused and path.exists()
    path.write_text("3")
    hold.check(s)
    assert s._engine_paused


def test_arm_renames_the_whole_count_into_place(tmp_path):
    path = tmp_path / "hold"
    arm(str(path), 4)
    assert path.read_text() == "4" and sorted(p.name for p in tmp_path.iterdir()) == ["hold"]
    s = scheduler(Req(4))
    RelayHold(str(path)).check(s)
    assert s._engine_paused and (tmp_path / f"hold{HELD_SUFFIX}").read_text() == "4"


def test_disarmed_between_read_and_pause_still_holds_cleanly(tmp_path):
    """The test disarms (removes the file) while RLD's iteration has just read it: RLD holds and
    says so, and the scheduler thread gets no exception."""
    path = tmp_path / "hold"
    arm(str(path), 2)

    class DisarmedAfterRead(RelayHold):
        def armed_at(self):
            at = super().armed_at()
            path.unlink()
            return at

    s = scheduler(Req(2))
    DisarmedAfterRead(str(path)).check(s)
    assert s._engine_paused and (tmp_path / f"hold{HELD_SUFFIX}").read_text() == "2"


def test_unset_means_no_hold_and_the_launcher_passes_a_servers_own_environment():
    assert RelayHold.from_env({}) is None
    spec = ServerSpec("relay-0", "relay", 30000, extra_env={RELAY_HOLD_FILE_ENV: "/x/hold"})
    assert server_env(spec)[RELAY_HOLD_FILE_ENV] == "/x/hold"
    assert RELAY_HOLD_FILE_ENV not in server_env(ServerSpec("relay-0", "relay", 30000))


def test_the_hold_never_writes_through_a_planted_symlink_or_a_file_it_did_not_create(tmp_path):
    """With its environment variable set, the hold wrote ``<file>.held.tmp`` with open(..., "w"):
    a symlink planted there made it overwrite the file the link named. Now it writes only a file
    it creates itself (O_CREAT | O_EXCL | O_NOFOLLOW), and reads its arming without following a link."""
    path, victim = tmp_path / "hold", tmp_path / "victim"
    victim.write_text("precious")
    tmp = tmp_path / f"hold{HELD_SUFFIX}.tmp"
    tmp.symlink_to(victim)
    path.write_text("2")
    s = scheduler(Req(2))
    RelayHold(str(path)).check(s)
    assert s._engine_paused and not path.exists()  # the hold fired (RLD paused, disarmed)
    assert victim.read_text() == "precious" and tmp.is_symlink()  # nothing written through the link
    assert not (tmp_path / f"hold{HELD_SUFFIX}").exists()

    tmp.unlink()
    tmp.write_text("someone else's")  # a plain file it did not create: left alone too
    path.write_text("2")
    s = scheduler(Req(2))
    RelayHold(str(path)).check(s)
    assert s._engine_paused and tmp.read_text() == "someone else's"

    secret = tmp_path / "secret"
    secret.write_text("7")
    path.symlink_to(secret)  # an arming that is a link is refused, not followed
    s = scheduler(Req(9))
    RelayHold(str(path)).check(s)
    assert not s._engine_paused and not path.exists() and secret.read_text() == "7"
