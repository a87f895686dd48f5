"""`pool demo`: the whole mission in one command, on the embedded default.
What it starts and the scenes it plays: docs/architecture.md#the-embedded-default.
"""

from __future__ import annotations

import signal
import threading
import time

from local.demo_checks import Checks


class Demo(Checks):
    """One run of the demo; `run()` returns the process exit code."""

    def run(self) -> int:
        self.t0 = time.monotonic()
        if threading.current_thread() is threading.main_thread():
            # `kill`/`timeout` stop the demo as Ctrl-C does: through the teardown below, so no
            # server, agent or fleet is left running
            signal.signal(signal.SIGTERM, _interrupt)
        self.setup()
        threads = [threading.Thread(target=f, daemon=True) for f in (self.committer,
                                                                     self.watcher)]
        for th in threads:
            th.start()
        try:
            story = threading.Thread(target=self.scenario, daemon=True)
            story.start()
            from local.dashboard import Dashboard

            with Dashboard(self, live=self.live):
                story.join()
                # the story ends by itself in ~30 s here; a loaded machine gets the time it needs
                self.settle(timeout=max(30.0, 150 - self.elapsed()))
            self.judge()
            self._stop.set()
            for th in threads:
                th.join(5)
            self.audit()
            self.report()
            if self.keep:
                self.say("still running (--keep): Ctrl-C to stop")
                try:
                    while True:
                        time.sleep(1)
                except KeyboardInterrupt:
                    pass
        finally:
            self._stop.set()
            self.teardown()
        return 0 if all(c.ok for c in self.checks.values()) else 1


def _interrupt(_signum: int, _frame: object) -> None:
    raise KeyboardInterrupt
