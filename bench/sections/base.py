"""What a bench section is."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

Results = dict[str, Any]


@dataclass(frozen=True)
class Section:
    """One section of the bench.

    Attributes:
        name: Its key in latest.json and its name for `--only`.
        run: Measures; `run(quick)` uses fewer repeats and smaller states when `quick`.
        publish: Puts a measurement into the results, for a section whose figures also live elsewhere
            than under its own name (None: `results[name] = value`).
    """

    name: str
    run: Callable[[bool], Results]
    publish: Callable[[Results, Results], None] | None = None

    def store(self, results: Results, value: Results) -> None:
        """Put this section's measurement `value` into `results`."""
        if self.publish is None:
            results[self.name] = value
        else:
            self.publish(results, value)
