"""What a person sees of a run: stdlib ``logging`` on rank 0, a bar on a terminal, plain
lines in a batch log, and the same messages in ``RUN/train.log``.

On a TTY (and ``log.progress=true``) a tqdm bar shows the step, ETA, img/s, and the loss
and s of the last metrics record (every ``log.every`` steps: reading them every step would
make the trainer wait for the GPU); messages are written above it. Otherwise (a batch
system's log file, or ``log.progress=false``) every ``log.every`` steps one plain line says
where the run is::

    step 120/800 (15%) epoch 2 loss 4.1234 lr 0.09500 s 30.00 theta_med 1.063 img/s 412
    ETA 0:03:12 mem 812 MiB

(on one line; with data at a URL, ``storage 3%`` after the img/s: the share of the time the
loader waited on the store since the last line). Before the process group exists, use
``trainer.telemetry.logger.print_main``.
"""

from __future__ import annotations

import logging
import math
import sys
from datetime import datetime, timedelta
from pathlib import Path

from tqdm import tqdm

LOGGER = "launch.run"
LOG_FILE = "train.log"


class RankZeroFilter(logging.Filter):
    """Pass records on global rank 0 only (every rank logs; one speaks)."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.rank = rank

    def filter(self, record: logging.LogRecord) -> bool:
        return self.rank == 0


class _ConsoleHandler(logging.StreamHandler):
    """stderr, through ``tqdm.write`` while a bar is drawn (so the bar stays at the bottom);
    skips records marked ``file_only``."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)
        self.bar: tqdm | None = None

    def emit(self, record: logging.LogRecord) -> None:
        if getattr(record, "file_only", False):
            return
        if self.bar is None:
            super().emit(record)
        else:
            self.bar.write(self.format(record), file=self.stream)


class _LogFile(logging.FileHandler):
    """RUN/train.log; an OSError (a full disk) is kept in ``error`` for the run to stop on,
    instead of logging's traceback on stderr for every later record."""

    error: OSError | None = None

    def handleError(self, record: logging.LogRecord) -> None:  # noqa: N802 - logging's name
        err = sys.exc_info()[1]
        if not isinstance(err, OSError):
            super().handleError(record)
        elif self.error is None:
            self.error = err


class Console:
    """Rank 0's console and ``RUN/train.log`` (appended across resumes)."""

    def __init__(self, run_dir: Path, rank: int, progress: bool) -> None:
        self.log = logging.getLogger(LOGGER)
        close_handlers(self.log)  # a previous run in this process (tests, notebooks)
        self.log.setLevel(logging.INFO)
        self.log.propagate = False
        self.log.filters.clear()
        self.log.addFilter(RankZeroFilter(rank))
        self._console = _ConsoleHandler()
        self._console.setFormatter(logging.Formatter("%(message)s"))
        self.log.addHandler(self._console)
        self.file: _LogFile | None = None
        if rank == 0:
            file = self.file = _LogFile(Path(run_dir) / LOG_FILE, delay=True)
            file.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
            self.log.addHandler(file)
        self.use_bar = progress and sys.stderr.isatty()
        self.bar: tqdm | None = None
        self._shown = "loss=- s=-"  # the bar's numbers from the last metrics record

    def start(self, step: int, total: int) -> None:
        if self.use_bar:
            self.bar = tqdm(total=total, initial=step, unit="step", dynamic_ncols=True,
                            file=sys.stderr)
            self._console.bar = self.bar

    def progress(self, step: int, img_s: float) -> None:
        """Every step: move the bar (no-op without one)."""
        if self.bar is not None:
            self.bar.set_postfix_str(f"{self._shown} img/s={img_s:.0f}", refresh=False)
            self.bar.update(step - self.bar.n)

    def metrics(self, record: dict, total: int, epoch: int | None, eta_s: float | None) -> None:
        """A metrics record: the bar's loss and s, one plain line when there is no bar, and
        always in train.log."""
        self._shown = (f"loss={_number(record.get('loss'), '.3f')} "
                       f"s={_number(record.get('scale'), '.2f')}" + _storage(record, "="))
        line = plain_line(record, total, epoch, eta_s)
        self.log.info(line, extra={"file_only": self.bar is not None})

    def info(self, message: str) -> None:
        self.log.info(message)

    def close_bar(self) -> None:
        """Close the bar, so that what is printed next starts on a line of its own."""
        if self.bar is not None:
            self.bar.close()
        self._console.bar = self.bar = None

    def close(self) -> None:
        self.close_bar()
        close_handlers(self.log)


def append_log(run_dir: Path, message: str) -> None:
    """Append ``message`` to ``RUN/train.log`` with the file handler's timestamp, from any rank
    and before or after the run's :class:`Console` exists: the config's warnings (found before
    the run folder is made) and each rank's fatal error belong in the run's record. A failure
    to write is ignored: it must not hide the error being reported."""
    stamp = datetime.now().strftime("%Y-%m-%d %H:%M:%S,%f")[:-3]  # logging's asctime
    lines = "".join(f"{stamp} {line}\n" for line in message.rstrip("\n").splitlines())
    try:
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        with open(Path(run_dir) / LOG_FILE, "a") as file:
            file.write(lines)
    except OSError:
        pass


def close_handlers(log: logging.Logger) -> None:
    for handler in list(log.handlers):
        log.removeHandler(handler)
        handler.close()


def _number(value, fmt: str) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "nan"
    return format(value, fmt)


def _storage(record: dict, sep: str) -> str:
    """`` storage 3%`` (``sep`` between the two) when the record has the loader's share of
    time waiting on a store, else ""."""
    share = record.get("storage_wait_share")
    return "" if share is None else f" storage{sep}{100 * share:.0f}%"


def plain_line(record: dict, total: int, epoch: int | None, eta_s: float | None) -> str:
    """``step 120/800 (15%) epoch 2 loss ... ETA 0:03:12 mem 812 MiB`` from a metrics record
    (``epoch`` 0-based, shown 1-based; ``theta_med`` in radians)."""
    step = record["step"]
    parts = [f"step {step}/{total} ({100 * step / max(total, 1):.0f}%)"]
    if epoch is not None:
        parts.append(f"epoch {epoch + 1}")
    parts += [
        f"loss {_number(record.get('loss'), '.4f')}",
        f"lr {_number(record.get('lr'), '.5g')}",
        f"s {_number(record.get('scale'), '.2f')}",
        f"theta_med {_number(record.get('theta_med'), '.3f')}",
        f"img/s {_number(record.get('img_per_s'), '.0f')}" + _storage(record, " "),
    ]
    if eta_s is not None:
        parts.append(f"ETA {timedelta(seconds=round(eta_s))}")
    if record.get("memory_mb") is not None:
        parts.append(f"mem {record['memory_mb']:.0f} MiB")
    return " ".join(parts)
