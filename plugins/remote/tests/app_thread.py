"""An ASGI app served from a thread of the test process, for the fakes of servers that a real one
cannot stand in for (one that answers 503 on demand, SGLang's HTTP API without SGLang)."""

from __future__ import annotations

import threading
import time
from typing import Any


class AppThread:
    """Serves ``app`` with uvicorn on a free 127.0.0.1 port (``url``) until :meth:`stop`."""

    def __init__(self, app: Any) -> None:
        import uvicorn
        from rollout_engines_remote.launch import free_port

        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, name=f"uvicorn-{port}", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
