"""What a model server says of its own load: the metric names of each server kind, a scanner
that reads only those lines from a Prometheus text page, and the score and "full" rule the pick
and the admission queue use. Pure: the scraper (`gateway.registry.scrape`) passes the bytes and
`now`.

- **Names**: a preset maps the three figures Sluice reads (requests running, requests waiting,
  KV-cache use 0-1) to a server's metric names; the policy's `names:` overrides any of them. A
  name may carry label matchers, `name{key="value"}` (Triton's TensorRT-LLM metrics are one
  family told apart by a label). Series of one name are summed (several engines, several
  models), except KV-cache use, of which the largest counts.
- **Scanner**: the page is searched for each name at a line start (`bytes.find`, no full
  parse) and read from there while its lines last: comments, histograms and the hundreds of
  other series are skipped at memchr speed. A
  name the page does not have is reported (`missing`), never read as 0: a server that renamed a
  metric must show up in `/admin/state` and the log, not look idle.
- **Staleness**: figures older than `STALE_INTERVALS` scrape intervals count for nothing; the
  pick falls back to this gateway's own counts.
- **Score** (in requests in flight, added to this gateway's own count in the power-of-two pick
  and the prefix placement): `running` requests that this gateway did not send (another replica,
  a batch job, a client going around Sluice), plus `waiting × w_waiting`, plus
  `kv_cache × w_kv_cache`. With the defaults, a request waiting in the server's queue counts as
  two in flight (it waits for a slot and then runs) and a full KV cache as four: queue first,
  then KV cache, as the Gateway API Inference Extension's picker ranks them.
- **Full**: a member whose server reports `running >= max_in_flight` or any waiting request
  has no free slot, whatever this gateway's own count says.
"""

from __future__ import annotations

from dataclasses import dataclass

STALE_INTERVALS = 3  # figures older than this many scrape intervals are stale
FIGURES = ("running", "waiting", "kv_cache")

PRESETS: dict[str, dict[str, str]] = {
    "vllm": {
        "running": "vllm:num_requests_running",
        "waiting": "vllm:num_requests_waiting",
        "kv_cache": "vllm:kv_cache_usage_perc",  # vLLM < 0.10: vllm:gpu_cache_usage_perc
    },
    "sglang": {
        "running": "sglang:num_running_reqs",
        "waiting": "sglang:num_queue_reqs",
        "kv_cache": "sglang:token_usage",
    },
    "triton": {  # Triton with the TensorRT-LLM backend
        "running": 'nv_trt_llm_request_metrics{request_type="scheduled"}',
        "waiting": 'nv_trt_llm_request_metrics{request_type="waiting"}',
        "kv_cache": 'nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="fraction"}',
    },
}


@dataclass(frozen=True, slots=True)
class Weights:
    """In-flight requests one unit of each figure counts as."""

    running: float = 1.0  # per request running that this gateway did not send
    waiting: float = 2.0  # per request waiting in the server's queue
    kv_cache: float = 4.0  # for a full KV cache (use 1.0)


@dataclass(frozen=True, slots=True)
class Wanted:
    """One figure's metric: its name as bytes, the label matchers its series must carry."""

    figure: str
    text: str  # as the policy or preset wrote it
    name: bytes
    labels: tuple[bytes, ...]  # each `key="value"`


@dataclass(frozen=True, slots=True)
class Figures:
    """One scrape's reading: a figure the page did not have is None (and named in `missing`)."""

    running: float | None
    waiting: float | None
    kv_cache: float | None
    missing: tuple[str, ...]  # metric names (as written) not found on the page
    at: float  # when it was read


def wanted(preset: str, names: dict[str, str | None]) -> tuple[Wanted, ...]:
    """The metrics to read: the preset's names with `names` overriding (ValueError on a
    malformed name)."""
    table = dict(PRESETS[preset])
    for k, v in names.items():
        if v is not None:
            table[k] = v
    return tuple(parse_name(f, table[f]) for f in FIGURES if f in table)


def parse_name(figure: str, text: str) -> Wanted:
    """`name` or `name{key="value",...}` → a `Wanted` (ValueError when malformed)."""
    name, brace, rest = text.partition("{")
    if not name or any(c.isspace() or c in '"}' for c in name):
        raise ValueError(f"bad metric name {text!r}")
    labels: tuple[bytes, ...] = ()
    if brace:
        if not rest.endswith("}"):
            raise ValueError(f"bad label matchers in {text!r}: no closing brace")
        out: list[bytes] = []
        for p in (p.strip() for p in rest[:-1].split(",")):
            if not p:
                continue
            key, eq, value = (x.strip() for x in p.partition("="))
            value = value[1:-1] if len(value) >= 2 and value[0] == value[-1] == '"' else value
            if not eq or not key.isidentifier() or not value or '"' in value:
                raise ValueError(f'bad label matcher {p!r} in {text!r} (want key="value")')
            out.append(f'{key}="{value}"'.encode())  # as the exposition format writes it
        labels = tuple(out)
    return Wanted(figure, text, name.encode(), labels)


def scan(page: bytes | bytearray, want: tuple[Wanted, ...], now: float, start: int = 0) -> Figures:
    """The figures of `want` read from a Prometheus text page that starts at `start` of `page`
    (see the module docstring)."""
    got: dict[str, float] = {}
    missing: list[str] = []
    for w in want:
        v = _read(page, w, start)
        if v is None:
            missing.append(w.text)
        else:
            got[w.figure] = v
    return Figures(got.get("running"), got.get("waiting"), got.get("kv_cache"),
                   tuple(missing), now)  # fmt: skip


def _read(page: bytes | bytearray, w: Wanted, start: int) -> float | None:
    """The sum (KV cache: the largest) of the values of `w`'s series. The exposition format
    keeps a metric's lines together, so the search stops at the first line after them: a page of
    100 KB of histograms costs one `find` up to the first series, not a walk of the page."""
    name = w.name
    n = len(name)
    size = len(page)
    total: float | None = None
    kv = w.figure == "kv_cache"
    i = page.find(name, start)
    while i >= 0 and not (
        (i == start or page[i - 1] == 0x0A) and page[i + n : i + n + 1] in (b"{", b" ")
    ):
        i = page.find(name, i + n)  # a comment, or a longer name (..._total, ..._by_reason)
    if i < 0:
        return None
    while True:
        pos = i + n
        end = page.find(b"\n", pos)
        if end < 0:
            end = size
        v = _value(page, pos, end, w.labels)
        if v is not None:
            if total is None:
                total = v
            elif kv:
                total = max(total, v)
            else:
                total += v
        i = end + 1  # the next line: still this metric's?
        if page[i : i + n] != name or page[i + n : i + n + 1] not in (b"{", b" "):
            return total


def _value(page: bytes | bytearray, pos: int, end: int, labels: tuple[bytes, ...]) -> float | None:
    """The value of the sample line `page[pos:end]` (after the name), if its labels match."""
    if page[pos] == 0x7B:  # "{"
        close = page.rfind(b"}", pos, end)
        if close < 0:
            return None
        if labels:
            block = page[pos + 1 : close]
            for lab in labels:
                if not _has_label(block, lab):
                    return None
        pos = close + 1
    elif labels:
        return None
    fields = page[pos:end].split()
    if not fields:
        return None
    try:
        v = float(fields[0])
    except ValueError:
        return None
    return None if v != v else v  # NaN says nothing


def _has_label(block: bytes | bytearray, lab: bytes) -> bool:
    i = block.find(lab)
    while i >= 0:
        if i == 0 or block[i - 1] in b", {":
            return True
        i = block.find(lab, i + 1)
    return False


def fresh(f: Figures | None, now: float, interval_s: float) -> bool:
    return f is not None and now - f.at <= STALE_INTERVALS * interval_s


def score(f: Figures, in_flight: int, w: Weights) -> float:
    """Requests in flight the server's figures add to this gateway's own count (>= 0)."""
    s = 0.0
    if f.running is not None:
        s += max(0.0, f.running - in_flight) * w.running
    if f.waiting is not None:
        s += max(0.0, f.waiting) * w.waiting
    if f.kv_cache is not None:
        s += min(max(f.kv_cache, 0.0), 1.0) * w.kv_cache
    return s


def full(f: Figures, max_in_flight: int | None) -> bool:
    """The server has no free slot: it reports a waiting request, or `running >= max_in_flight`."""
    if f.waiting is not None and f.waiting > 0:
        return True
    return max_in_flight is not None and f.running is not None and f.running >= max_in_flight


def slots(per_member: int, server_full: bool, in_flight: int) -> int:
    """Admission slots a member gives its pool: `per_member`, or while its server is full only
    those this gateway's requests hold on it already (no new one goes there)."""
    return min(per_member, in_flight) if server_full else per_member
