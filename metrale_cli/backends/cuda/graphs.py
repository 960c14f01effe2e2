"""CUDA graphs of the rows path: each (kind, rows) pass is captured once and replayed.  Its launches read the
token ids and positions from the engine's io buffer (one async copy before each replay) and write its
preallocated buffers, so one graph serves every step."""

from __future__ import annotations

from typing import Any, Callable


class RowsGraphs:
    """The captured rows passes of one engine, on its stream and kernels (`kern.pdl` is on while a pass is
    launched with programmatic dependent launch)."""

    def __init__(self, stream: Any, kern: Any, use_pdl: bool) -> None:
        self.stream, self.kern = stream, kern
        self.use_pdl = use_pdl  # launch the captured passes with PDL (sm_90+)
        self._graphs: dict[tuple[str, int], Any] = {}

    def __len__(self) -> int:
        return len(self._graphs)

    def clear(self) -> None:
        """Forget every graph (the next run of each pass captures it again)."""
        self._graphs.clear()

    def run(self, key: tuple[str, int], body: Callable[[], None], check: Callable[[], None]) -> None:
        """Replay the graph of pass `key`, capturing it first: `body()` once eagerly (it compiles and allocates
        outside the capture), then `check()` (the engine's checks of that warm-up), then `body()` captured."""
        graph = self._graphs.get(key)
        if graph is None:
            with self.stream:
                body()
            self.stream.synchronize()
            check()
            self.stream.begin_capture()
            try:
                with self.stream:
                    self.with_pdl(body)
            finally:
                graph = self.stream.end_capture()
            self._graphs[key] = graph
        graph.launch(stream=self.stream)

    def with_pdl(self, body: Callable[[], None]) -> None:
        """Run `body()` with the kernels launching under PDL where use_pdl says so."""
        self.kern.pdl = self.use_pdl
        try:
            body()
        finally:
            self.kern.pdl = False
