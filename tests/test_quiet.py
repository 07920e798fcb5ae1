"""The CLI's filter on other packages' logs: INFO off, warnings and errors one line, ours untouched."""

import asyncio
import gc
import logging
import sys

from kvgraft_jax.cli import quiet


def _record(pathname, level, msg, args=None, exc_info=None, name="orbax"):
    return logging.LogRecord(name, level, pathname, 1, msg, args, exc_info)


def _exc_info():
    try:
        raise ValueError("RESOURCE_EXHAUSTED: No space left on device")
    except ValueError:
        return sys.exc_info()


def test_our_records_pass_untouched_and_third_party_info_is_dropped():
    import kvgraft_jax.run.runtime
    import kvgraft_jax.store.restore

    keep = quiet.ThirdPartyFilter()
    # Ours from every sub-package, not only the CLI's own.
    for module in (kvgraft_jax.store.restore, kvgraft_jax.run.runtime, quiet):
        ours = _record(module.__file__, logging.INFO, "compiled %s", ("x",))
        assert keep.filter(ours) and ours.getMessage() == "compiled x", module.__name__
    assert not keep.filter(_record("/site-packages/orbax/checkpoint.py", logging.INFO, "saved"))
    assert not keep.filter(_record("/site-packages/orbax/checkpoint.py", logging.DEBUG, "saved"))


def test_third_party_errors_become_one_line_without_their_traceback():
    keep = quiet.ThirdPartyFilter()
    record = _record(
        "/site-packages/orbax/future.py",
        logging.ERROR,
        "thread raised: %s\nspec: %s",
        ("RESOURCE_EXHAUSTED", "x" * 5000),
        exc_info=_exc_info(),
    )
    assert keep.filter(record)
    assert record.getMessage() == "thread raised: RESOURCE_EXHAUSTED [...]"
    assert record.exc_info is None and record.exc_text is None
    formatted = logging.Formatter().format(record)
    assert "Traceback" not in formatted and "\n" not in formatted


def _asyncio_record(forget) -> logging.LogRecord:
    """The one record asyncio itself logs when `forget()` (run in a loop) leaves a failure that
    nobody read, once it is collected."""
    records: list[logging.LogRecord] = []

    class Capture(logging.Handler):
        def emit(self, record):
            records.append(record)

    capture = Capture()
    asyncio_logger = logging.getLogger("asyncio")
    asyncio_logger.addHandler(capture)
    try:
        asyncio.run(forget())
        gc.collect()
    finally:
        asyncio_logger.removeHandler(capture)
    assert len(records) == 1, records
    return records[0]


def _asyncio_late_task_record() -> logging.LogRecord:
    """A failed task nobody awaited: its message carries the task's repr on the lines after the
    note (`future: <Task ...>`)."""

    async def fails():
        raise ValueError("RESOURCE_EXHAUSTED: No space left on device")

    async def start_and_forget():
        task = asyncio.ensure_future(fails())
        await asyncio.sleep(0)  # the task runs and fails; nobody reads its exception
        del task

    return _asyncio_record(start_and_forget)


def _asyncio_late_future_record() -> logging.LogRecord:
    """A future that failed and that nobody read."""

    async def fail_and_forget():
        future = asyncio.get_running_loop().create_future()
        future.set_exception(ValueError("RESOURCE_EXHAUSTED: No space left on device"))
        del future

    return _asyncio_record(fail_and_forget)


def _asyncio_late_gather_record() -> logging.LogRecord:
    """`asyncio.gather` over a failed future, the gather's own future never read (its child's
    exception is read by the gather)."""

    async def gather_and_forget():
        child = asyncio.get_running_loop().create_future()
        gathered = asyncio.gather(child)
        child.set_exception(ValueError("RESOURCE_EXHAUSTED: No space left on device"))
        await asyncio.sleep(0)  # the gather's callback runs and fails the gather
        del gathered, child

    return _asyncio_record(gather_and_forget)


def test_asyncio_late_task_notes_are_dropped_and_malformed_calls_are_left_to_the_handler():
    keep = quiet.ThirdPartyFilter()
    late = _asyncio_late_task_record()
    # The full disk run printed this record after our last line when the filter compared the
    # whole message with the note's first line.
    assert "\nfuture: <Task" in late.getMessage()
    assert not keep.filter(late)
    # The same note on a plain future came after our line in 1 of 6 full-disk deposits.
    late_future = _asyncio_late_future_record()
    assert late_future.getMessage().startswith("Future exception was never retrieved")
    assert not keep.filter(late_future)
    # A gather's note came after our line once in three full test runs (format 2's deposit).
    late_gather = _asyncio_late_gather_record()
    assert late_gather.getMessage().startswith("_GatheringFuture exception was never retrieved")
    assert not keep.filter(late_gather)
    # Only asyncio's note: another asyncio error, or the phrase inside a message, still shows.
    other = _record("/usr/lib/python3.11/asyncio/base_events.py", logging.ERROR, "x")
    other.name, other.msg = "asyncio", "Unclosed client session exception was never retrieved"
    assert keep.filter(other)
    malformed = _record("/site-packages/jax/x.py", logging.WARNING, "%d items", ("many",))
    assert keep.filter(malformed)  # no exception here; logging's handleError reports it


def test_install_is_idempotent_and_verbose_installs_nothing(monkeypatch):
    handler = logging.StreamHandler()
    monkeypatch.setattr(sys, "unraisablehook", sys.__unraisablehook__)
    quiet.install(handler, verbose=True)
    assert handler.filters == [] and sys.unraisablehook is sys.__unraisablehook__
    quiet.install(handler, verbose=False)
    quiet.install(handler, verbose=False)
    assert len(handler.filters) == 1
    assert getattr(sys.unraisablehook, "_kvgraft_quiet", False)
    previous = sys.unraisablehook.__closure__[0].cell_contents
    assert previous is sys.__unraisablehook__  # installed once, not chained onto itself


def test_the_unraisable_hook_drops_only_the_closed_loop_callback(monkeypatch):
    seen = []
    monkeypatch.setattr(sys, "unraisablehook", seen.append)
    quiet.install(logging.StreamHandler(), verbose=False)

    class Unraisable:
        def __init__(self, value):
            self.exc_type, self.exc_value = type(value), value

    sys.unraisablehook(Unraisable(RuntimeError("Event loop is closed")))
    other = Unraisable(RuntimeError("something else"))
    sys.unraisablehook(other)
    assert seen == [other]
