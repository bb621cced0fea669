"""The matrix clock of one server in one causality domain.

The servers of a domain are numbered ``0..k-1`` (the domain's own indexes: the caller maps server
ids to them). Server ``me`` keeps a k x k matrix ``H``; ``H[a][b]`` is what ``me`` knows of how many
messages ``a`` has sent to ``b``. Row ``me`` is exact (these are our own sends) and so is column
``me`` (what we have delivered); everything else is second-hand knowledge that travels in stamps.

- send to ``j``: ``H[me][j] += 1`` and the message carries a stamp;
- a message from ``i`` stamped ``Hm`` is deliverable when ``Hm[i][me] == H[i][me] + 1`` (the next on
  its link) and ``Hm[a][me] <= H[a][me]`` for every other ``a`` (we hold every message sent to us
  that the sender had heard of); delivering merges ``H = max(H, Hm)``;
- ``Hm[i][me] <= H[i][me]`` is a duplicate (a resend after a crash or a lost ack).

One event (a reaction) may send several messages (:meth:`DomainClock.prepare_sends`): all are
counted before any is stamped, so each stamp carries its siblings. Siblings on one link share a
stamp whose link counter ``Hm[i][me]`` is the last of them; each travels with its own sequence
number ``seq``, which takes the counter's place in the tests above (``check(src, stamp, seq)``),
and delivering it sets ``H[i][me] = seq``. The receiver delivers them all at once (the caller's
part: :meth:`DomainClock.event_end` says how many are coming), so that nothing it does after the
first can precede the others.

Two stamp encodings, each tied to a way of persisting the matrix:

``"full"``
    The report's baseline: every stamp carries the whole matrix, and the whole matrix is one ZODB
    record rewritten on every change. Both costs grow as k^2; that is the point of keeping it.
``"delta"``
    The report's first optimisation, as the industrial kernel shipped it: a stamp carries only the
    cells that changed since the last send to that destination. Instead of the kernel's scan of
    the whole matrix on every send, changes are kept in a list ordered by the time they happened,
    so a send walks back only over what changed since its previous send.

With ``order="fifo"`` only the link counters matter: the stamp is one counter and the check is the
FIFO/duplicate test alone.

Delta storage. Each ZODB record a commit writes costs a fixed overhead (pickling, store, index)
that dwarfs its size up to several KB, so the state is cut into as few records as a commit can
touch. All of it -- matrix cells, change list, epoch -- lives in uint64 ``array`` pages
(:class:`_Page`), no other record changes after creation:

- causal: node ``a*k+b`` is the entry ``H[a][b]``, three cells (value; epoch << 16 | source;
  prev << 32 | next). Node ``k*k`` is the change list's sentinel: it closes the circular list and
  holds the epoch. A domain whose nodes fit :data:`_SINGLE_PAGE_BYTES` (k <= 18) is one page: every
  transaction, whatever it does to the clock, rewrites exactly one record. Larger domains use pages
  of ``2**_PAGE_BITS`` nodes, and a commit rewrites the pages of the nodes it changed: the
  entries, their old neighbours in the list, and the sentinel's page.
- fifo: two cells per server, ``H[me][b]`` then ``H[b][me]``, so that both directions of a link
  share a page; one page up to k = 512.

The epoch of our last send to ``b`` needs no storage of its own: row ``me`` changes only when we
send (a stamp can never raise it, see ``_decode``), so it is the epoch of the entry ``H[me][b]``.

The clock keeps no state outside ZODB persistent objects (only ``_v_`` tracing caches): an aborted
transaction rolls the clock back together with the queues it was saved with. The clock is not
thread-safe and two transactions that change it concurrently conflict: one writer at a time.

Wire format of a stamp (little-endian, built with :mod:`struct`, never pickled)::

    header  B version (=1) | B kind (1 full, 2 delta, 3 fifo) | H k | H sender | H receiver
    full    k*k  q          -- the matrix, row-major
    delta   n * (I key, q value)  -- key = a*k + b; n >= 1, the link counter always among them
    fifo    q               -- the link counter Hm[sender][receiver]
"""

from __future__ import annotations

import enum
import struct
import sys
from array import array
from typing import Any, Final, NamedTuple

import persistent

from aaabus.errors import ClockError

__all__ = [
    "HEADER_SIZE",
    "KIND_DELTA",
    "KIND_FIFO",
    "KIND_FULL",
    "MAX_SIZE",
    "STAMP_VERSION",
    "ClockError",
    "DomainClock",
    "Verdict",
]


class Verdict(enum.Enum):
    """What to do with a received message."""

    DELIVER = "deliver"  # deliver now, then merge its stamp with deliver()
    WAIT = "wait"  # something it depends on has not been delivered yet: hold it back
    DUPLICATE = "duplicate"  # already delivered: drop it (and ack it again)


STAMP_VERSION: Final = 1
KIND_FULL: Final = 1
KIND_DELTA: Final = 2
KIND_FIFO: Final = 3
_KIND_NAMES: Final = {KIND_FULL: "full", KIND_DELTA: "delta", KIND_FIFO: "fifo"}

#: k must fit the header's uint16, and then every key a*k+b fits a delta entry's uint32.
MAX_SIZE: Final = 0xFFFF

_HEADER: Final = struct.Struct("<BBHHH")
HEADER_SIZE: Final = _HEADER.size
_ENTRY_SIZE: Final = struct.calcsize("<Iq")
_FIFO_BODY: Final = struct.Struct("<q")
_FIFO_STAMP: Final = struct.Struct("<BBHHHq")
_BIG_ENDIAN: Final = sys.byteorder == "big"
_NEVER_STORED: Final = b"\0" * 8

# Delta storage (see the module docstring). Causal: three uint64 cells per node.
_STRIDE: Final = 3
# VAL: the entry's value. TAG: epoch << 16 | src, where epoch is the local epoch of the entry's
# last change (0: never changed, so not in the change list) and src who is sure to know the value
# (the sender of the message it came from, or me for my own sends); the sentinel's VAL is the
# epoch of the last operation (epochs < 2**48: centuries of operations). LIST: prev << 32 | next,
# the change list (node numbers < 2**32).
_VAL, _TAG, _LIST = range(_STRIDE)
_SRC_BITS: Final = 16
_SRC_MASK: Final = (1 << _SRC_BITS) - 1
_LOW: Final = 0xFFFFFFFF
_HIGH: Final = _LOW << 32
# Fifo: two cells per server, at 2*b: H[me][b] (sends) and H[b][me] (deliveries).
_OUT, _IN = 0, 1
# A domain whose cells fit this many bytes is one page (causal: k <= 18; fifo: k <= 512). The
# constant cost of a record is worth some 6 KB of its size (FileStorage), so past this a commit is
# cheaper with pages just big enough to amortise their pickle framing: the few nodes an operation
# changes are scattered over the matrix anyway, bigger pages would rarely share them.
_SINGLE_PAGE_BYTES: Final = 8192
_PAGE_BITS: Final = 5
#: Shift that maps every node of a single-page domain to page 0 (nodes < 2**32, see MAX_SIZE).
_ONE_PAGE_BITS: Final = 32
# Rough pickle overhead of one small ZODB record (class reference, state dict, framing).
_RECORD_OVERHEAD: Final = 96

_MAX_CACHED_STRUCT: Final = 64
_delta_structs: dict[int, struct.Struct] = {}


def _delta_struct(n: int) -> struct.Struct:
    """The struct of a delta stamp with ``n`` entries (header included), cached for small n."""
    s = _delta_structs.get(n)
    if s is None:
        s = struct.Struct("<BBHHH" + "Iq" * n)
        if n <= _MAX_CACHED_STRUCT:
            _delta_structs[n] = s
    return s


class _Page(persistent.Persistent):
    """Consecutive nodes of the delta state, ``stride`` uint64 cells each, as one ZODB record.

    ``array`` is not persistence-aware: whoever mutates ``d`` sets ``_p_changed`` itself.
    """

    d: array[int]

    def __init__(self, cells: int) -> None:
        self.d = array("Q", bytes(8 * cells))


def _paginate(nodes: int, stride: int) -> tuple[int, tuple[_Page, ...]]:
    """``(bits, pages)``: node ``x`` is at ``pages[x >> bits].d[(x & mask) * stride]``."""
    if nodes * stride * 8 <= _SINGLE_PAGE_BYTES:
        return _ONE_PAGE_BITS, (_Page(nodes * stride),)
    per_page = 1 << _PAGE_BITS
    full, rest = divmod(nodes, per_page)
    sizes = [per_page] * full + ([rest] if rest else [])
    return _PAGE_BITS, tuple(_Page(n * stride) for n in sizes)


# Storage modes: the stamp encoding decides how the matrix is persisted, the order what is kept.
_FULL_CAUSAL: Final = 0
_FULL_FIFO: Final = 1
_DELTA_CAUSAL: Final = 2
_DELTA_FIFO: Final = 3
_MODE_KIND: Final = (KIND_FULL, KIND_FIFO, KIND_DELTA, KIND_FIFO)


class _Parsed(NamedTuple):
    """A received stamp taken apart (:meth:`DomainClock._parse`); entries are ``(a*k + b,
    value)`` pairs, in the order of the stamp."""

    link: int  # Hm[src][me]: the seq of the last message its event sent on this link
    entries: tuple[tuple[int, int], ...]  # delta: all; full: the non-zero ones; fifo: none
    column: tuple[tuple[int, int], ...]  # those of column me but the link's: what can make WAIT
    own: tuple[tuple[int, int], ...]  # those of row me: what must not be ahead of us
    matrix: array[int] | None  # full: the whole matrix, for the merge


# (mode, k, me, pages, bits, mask): see DomainClock._fast.
_Fast = tuple[int, int, int, tuple[_Page, ...], int, int]


class DomainClock(persistent.Persistent):
    """Matrix clock of server ``me`` (an index in ``0..size-1``) in one causality domain.

    ``stamps`` is ``"delta"`` (default) or ``"full"``; ``order`` is ``"causal"`` (default) or
    ``"fifo"``. Usage on the receive side::

        verdict = clock.check(src, stamp, seq)     # pure
        if verdict is Verdict.DELIVER:             # and event_end(src, stamp) == seq, or the
            clock.deliver(src, stamp, seq)         # rest of the event is delivered with it

    :meth:`receive` does both with one decoding.
    """

    size: int
    me: int
    stamps: str
    order: str
    _mode: int
    _kind: int
    # "full": the whole matrix, row-major, in this very record.
    _m: array[int]
    # "delta": every changing cell, in pages (module docstring); node x is in _pages[x >> _bits].
    _pages: tuple[_Page, ...]
    _bits: int
    # Volatile (never stored, lost when the clock is reloaded): caches.
    _v_fast: _Fast
    _v_touched: dict[int, persistent.Persistent]
    _v_parsed: tuple[bytes, int, _Parsed]

    def __init__(self, size: int, me: int, *, stamps: str = "delta", order: str = "causal") -> None:
        if not 1 <= size <= MAX_SIZE:
            raise ValueError(f"clock size {size} out of range: a domain has 1..{MAX_SIZE} servers")
        if not 0 <= me < size:
            raise ValueError(f"clock index {me} out of range for a domain of {size} servers")
        if stamps not in ("delta", "full"):
            raise ValueError(f"unknown stamp encoding {stamps!r}: expected 'delta' or 'full'")
        if order not in ("causal", "fifo"):
            raise ValueError(f"unknown order {order!r}: expected 'causal' or 'fifo'")
        self.size = size
        self.me = me
        self.stamps = stamps
        self.order = order
        fifo = order == "fifo"
        self._kind = KIND_FIFO if fifo else (KIND_FULL if stamps == "full" else KIND_DELTA)
        if stamps == "full":
            self._mode = _FULL_FIFO if fifo else _FULL_CAUSAL
            self._m = array("q", bytes(8 * size * size))
        elif fifo:
            self._mode = _DELTA_FIFO
            self._bits, self._pages = _paginate(size, 2)
        else:
            self._mode = _DELTA_CAUSAL
            sentinel = size * size
            self._bits, self._pages = _paginate(sentinel + 1, _STRIDE)
            # The empty change list: the sentinel (the last node) is its own prev and next.
            d = self._pages[-1].d
            d[len(d) - _STRIDE + _LIST] = (sentinel << 32) | sentinel

    def __repr__(self) -> str:
        return (
            f"DomainClock(size={self.size}, me={self.me}, "
            f"stamps={self.stamps!r}, order={self.order!r})"
        )

    def _fast(self) -> _Fast:
        """``(mode, k, me, pages, bits, mask)``, cached in a volatile attribute.

        Every attribute read on a persistent object goes through its activation check (~3x a
        plain read); the hot paths read this one tuple instead. Only immutable values and
        references to persistent sub-objects are cached: ZODB keeps those objects identical for
        the life of the connection, and ``_v_`` attributes vanish whenever the clock is reloaded.
        """
        try:
            fast: _Fast = self._v_fast
        except AttributeError:
            mode = self._mode
            if mode in (_DELTA_CAUSAL, _DELTA_FIFO):
                bits = self._bits
                fast = (mode, self.size, self.me, self._pages, bits, (1 << bits) - 1)
            else:
                fast = (mode, self.size, self.me, (), 0, 0)
            self._v_fast = fast
        return fast

    # ----------------------------------------------------------------------------------- reading

    def entry(self, a: int, b: int) -> int:
        """``H[a][b]``: how many messages ``a`` sent to ``b``, as far as this server knows."""
        mode, k, me, pages, bits, mask = self._fast()
        if not (0 <= a < k and 0 <= b < k):
            raise ClockError(f"entry ({a}, {b}) out of range for a domain of {k} servers")
        if mode == _DELTA_CAUSAL:
            key = a * k + b
            return pages[key >> bits].d[(key & mask) * _STRIDE]
        if mode == _DELTA_FIFO:
            if a == me:
                return pages[b >> bits].d[(b & mask) * 2 + _OUT]
            if b == me:
                return pages[a >> bits].d[(a & mask) * 2 + _IN]
            return 0
        return self._m[a * k + b]

    def sent_to(self, dest: int) -> int:
        """``H[me][dest]``: messages this server has stamped for ``dest``."""
        return self.entry(self.me, dest)

    def received_from(self, src: int) -> int:
        """``H[src][me]``: messages from ``src`` this server has delivered."""
        return self.entry(src, self.me)

    # ------------------------------------------------------------------------------------ send

    def max_stamp_size(self) -> int:
        """The largest stamp this clock can make, in bytes (a delta listing every entry)."""
        mode, k, *_ = self._fast()
        if mode in (_DELTA_FIFO, _FULL_FIFO):
            return _FIFO_STAMP.size
        return HEADER_SIZE + (8 if mode == _FULL_CAUSAL else _ENTRY_SIZE) * k * k

    def prepare_send(self, dest: int) -> bytes:
        """Count one more message to ``dest`` and return its stamp.

        Call it in the transaction that saves the message in the outgoing queue: if that
        transaction aborts, the count and the delta bookkeeping roll back with it.
        """
        mode, k, me, pages, bits, mask = self._fast()
        if not 0 <= dest < k or dest == me:
            raise ClockError(
                f"cannot stamp a message from {me} to {dest}: the destination must be another "
                f"server of this domain (0..{k - 1})"
            )
        if mode == _DELTA_CAUSAL:
            stamp = self._send_delta(k, me, pages, bits, mask, dest)
        elif mode == _DELTA_FIFO:
            page = pages[dest >> bits]
            i = (dest & mask) * 2 + _OUT
            link = page.d[i] + 1
            page.d[i] = link
            self._touch(page)
            stamp = _FIFO_STAMP.pack(STAMP_VERSION, KIND_FIFO, k, me, dest, link)
        else:
            m = self._m
            key = me * k + dest
            m[key] += 1
            self._touch(self)
            if mode == _FULL_FIFO:
                stamp = _FIFO_STAMP.pack(STAMP_VERSION, KIND_FIFO, k, me, dest, m[key])
            else:
                body = m
                if _BIG_ENDIAN:
                    body = array("q", m)
                    body.byteswap()
                stamp = _HEADER.pack(STAMP_VERSION, KIND_FULL, k, me, dest) + body.tobytes()
        return stamp

    def prepare_sends(self, dests: list[int]) -> list[tuple[int, bytes]]:
        """Count the messages of one event, one per entry of ``dests``, and stamp each.

        ``(seq, stamp)`` per message, in the order of ``dests``: ``seq`` is the message's number
        on its link, which the caller sends beside the stamp. All the messages are counted
        *before* any is stamped, so every stamp carries the sends of all its siblings: whatever
        a receiver sends after delivering one of them is stamped with knowledge of the others,
        and their receivers hold it back until they have them. That makes one reaction (the
        caller's "event") one clock event.

        Siblings on one link carry the same stamp, whose link counter is the *last* of their
        seqs: the receiver checks each with its own ``seq`` (``check(src, stamp, seq)``) and,
        knowing from the counter that more of the event is on its way, delivers them all at once
        when the last has come (:meth:`event_end`). Delivering the first alone would let what
        its receiver does next overtake the others. Same transaction rule as
        :meth:`prepare_send`.
        """
        mode, k, me, pages, bits, mask = self._fast()
        for dest in dests:
            if not 0 <= dest < k or dest == me:
                raise ClockError(
                    f"cannot stamp a message from {me} to {dest}: the destination must be "
                    f"another server of this domain (0..{k - 1})"
                )
        if mode in (_DELTA_FIFO, _FULL_FIFO) or len(dests) == 1:
            # FIFO stamps carry no knowledge of other links; one send is its own event.
            sends = []
            for dest in dests:
                stamp = self.prepare_send(dest)
                sends.append((self.sent_to(dest), stamp))
            return sends
        counts: dict[int, int] = {}
        for dest in dests:
            counts[dest] = counts.get(dest, 0) + 1
        if mode == _DELTA_CAUSAL:
            bodies = self._count_delta(k, me, pages, bits, mask, counts)
            stamps = {
                dest: _delta_struct(len(flat) >> 1).pack(
                    STAMP_VERSION, KIND_DELTA, k, me, dest, *flat
                )
                for dest, flat in bodies.items()
            }
        else:
            m = self._m
            for dest, n in counts.items():
                m[me * k + dest] += n
            self._touch(self)
            body = array("q", m)
            if _BIG_ENDIAN:
                body.byteswap()
            matrix = body.tobytes()
            stamps = {
                dest: _HEADER.pack(STAMP_VERSION, KIND_FULL, k, me, dest) + matrix
                for dest in counts
            }
        out: list[tuple[int, bytes]] = []
        seqs = {dest: self.entry(me, dest) - n for dest, n in counts.items()}
        for dest in dests:
            seqs[dest] += 1
            out.append((seqs[dest], stamps[dest]))
        return out

    def _count_delta(
        self,
        k: int,
        me: int,
        pages: tuple[_Page, ...],
        bits: int,
        mask: int,
        counts: dict[int, int],
    ) -> dict[int, list[int]]:
        """Count ``counts[dest]`` sends to each ``dest`` in one epoch; each dest's stamp body.

        The body for ``dest`` is what :meth:`_send_delta` would send after all the counts: every
        entry changed since our previous send to ``dest``, less what ``dest`` is sure to know.
        The counts share one epoch, so a later send to ``dest`` (which walks back to the epoch
        of ``H[me][dest]``, this one) skips exactly the entries this event already sent it.
        """
        sentinel = k * k
        sd, si, epoch = self._next_epoch(pages, bits, mask, sentinel)
        last: dict[int, int] = {}
        for dest, n in counts.items():
            key = me * k + dest
            d = pages[key >> bits].d
            i = (key & mask) * _STRIDE
            last[dest] = d[i + _TAG] | _SRC_MASK
            self._change(pages, bits, mask, sentinel, key, d[i] + n, me, epoch)
        head = sd[si + _LIST] >> 32
        return {
            dest: _delta_entries(pages, bits, mask, sentinel, head, before, dest, k)
            for dest, before in last.items()
        }

    # Which entries a delta stamp to ``dest`` carries, and why that is enough.
    #
    # Claim: when ``dest`` delivers our n-th message, its matrix is >= (entry by entry) our matrix
    # as it was when we stamped that message. Then a delta check at ``dest`` gives the verdict a
    # full stamp would, and a delta merge leaves the matrix a full merge would.
    #
    # By induction on n. ``dest`` delivers our messages in the order we stamped them, with no gap
    # (the check demands Hm[me][dest] == H[me][dest] + 1, and a WAITing message is never merged),
    # so when it delivers the n-th it has delivered and merged the (n-1)-th, and by induction holds
    # >= our matrix at the (n-1)-th send (for n = 1: the all-zero matrix, "epoch 0"). An entry of
    # ours falls in one of four cases:
    #  1. unchanged since the (n-1)-th send: ``dest`` already holds >= it (induction);
    #  2. changed since, and sent: the merge raises ``dest`` to it;
    #  3. changed since, last changed by merging a message *from dest* (SRC == dest): our value
    #     is then the one ``dest`` put in that stamp, so ``dest`` held >= it when it sent that
    #     message. That send precedes our receipt, which precedes our n-th send, which precedes
    #     its delivery at ``dest``; its matrix only grows (and its sends are committed before
    #     they leave, so no crash can take that knowledge back). Hence it still holds >= it.
    #     Only the *last* change counts: if another server raised the entry after ``dest`` did,
    #     SRC is that server and the entry is sent. If ``dest`` raised it after another server,
    #     ``dest`` knows the larger value, which covers the smaller one;
    #  4. in row ``dest``: ``H[dest][b]`` counts ``dest``'s own sends, which ``dest`` knows
    #     exactly; nobody can know a larger value, so it is never worth sending to ``dest``.
    # The check itself only reads the entries present: the absent ones of column ``dest`` are
    # cases 1, 3 or 4, all <= what ``dest`` holds, so they could not have made it wait.
    #
    # The change list: every entry that ever changed sits in a circular doubly linked list,
    # closed by the sentinel node k*k, ordered by the time of its last change (moving to the tail
    # on each change), with the epoch of that change. A send to ``dest`` walks back from the tail
    # until it meets an epoch <= the epoch of the previous send to ``dest``: O(entries changed
    # since then), never the whole matrix. That epoch is the one of the entry H[me][dest] before
    # this send, since only our sends change row ``me``.

    def _send_delta(
        self, k: int, me: int, pages: tuple[_Page, ...], bits: int, mask: int, dest: int
    ) -> bytes:
        sentinel = k * k
        sd, si, epoch = self._next_epoch(pages, bits, mask, sentinel)
        key = me * k + dest
        d = pages[key >> bits].d
        i = (key & mask) * _STRIDE
        last = d[i + _TAG] | _SRC_MASK  # every tag of an epoch <= the previous send's is <= last
        self._change(pages, bits, mask, sentinel, key, d[i] + 1, me, epoch)
        flat = _delta_entries(pages, bits, mask, sentinel, sd[si + _LIST] >> 32, last, dest, k)
        return _delta_struct(len(flat) >> 1).pack(STAMP_VERSION, KIND_DELTA, k, me, dest, *flat)

    def _next_epoch(
        self, pages: tuple[_Page, ...], bits: int, mask: int, sentinel: int
    ) -> tuple[array[int], int, int]:
        """Open the next epoch of the change list, the one of an event's sends or of a merge:
        the sentinel's cells (``sd``), its index in them (``si``) and the new epoch."""
        sp = pages[sentinel >> bits]
        if not sp._p_changed:
            self._touch(sp)
        sd = sp.d
        si = (sentinel & mask) * _STRIDE
        epoch = sd[si] + 1
        sd[si] = epoch
        return sd, si, epoch

    def _change(
        self,
        pages: tuple[_Page, ...],
        bits: int,
        mask: int,
        sentinel: int,
        key: int,
        value: int,
        src: int,
        epoch: int,
    ) -> None:
        """Set entry ``key`` to ``value``, learned from ``src``, and move it to the list's tail.

        The caller has touched the sentinel's page. Pages are touched only when not already
        dirty: a second change to a page in the same transaction costs one attribute read.
        """
        page = pages[key >> bits]
        d = page.d
        i = (key & mask) * _STRIDE
        d[i] = value
        sd = pages[sentinel >> bits].d
        si = (sentinel & mask) * _STRIDE + _LIST
        tail = sd[si] >> 32
        if key != tail:
            if d[i + _TAG]:
                # In the list but not last: unlink. Its successor is an entry, not the sentinel.
                links = d[i + _LIST]
                prev = links >> 32
                nxt = links & _LOW
                pp = pages[prev >> bits]
                j = (prev & mask) * _STRIDE + _LIST
                pp.d[j] = (pp.d[j] & _HIGH) | nxt
                if not pp._p_changed:
                    self._touch(pp)
                np = pages[nxt >> bits]
                j = (nxt & mask) * _STRIDE + _LIST
                np.d[j] = (prev << 32) | (np.d[j] & _LOW)
                if not np._p_changed:
                    self._touch(np)
            d[i + _LIST] = (tail << 32) | sentinel
            tp = pages[tail >> bits]  # the sentinel's page when the list was empty
            j = (tail & mask) * _STRIDE + _LIST
            tp.d[j] = (tp.d[j] & _HIGH) | key
            if not tp._p_changed:
                self._touch(tp)
            sd[si] = (key << 32) | (sd[si] & _LOW)
        d[i + _TAG] = (epoch << _SRC_BITS) | src
        if not page._p_changed:
            self._touch(page)

    # --------------------------------------------------------------------------------- receive

    def check(self, src: int, stamp: bytes, seq: int | None = None) -> Verdict:
        """The verdict on a message from ``src`` carrying ``stamp``; changes nothing.

        ``seq`` is the message's number on its link, sent beside the stamp; None means the
        stamp's own link counter (the last message its event sent here, see
        :meth:`prepare_sends`), which is right for every message that had no sibling on its
        link. A DELIVER for a message whose event sent more here (``seq < event_end``) means
        "deliverable together with them": the caller holds it until they have all come.
        """
        return self._verdict(src, self._decoded(src, stamp), seq)

    def deliver(self, src: int, stamp: bytes, seq: int | None = None) -> None:
        """Merge the stamp of a message that :meth:`check` found deliverable.

        Refuses (ClockError, clock untouched) a message that is not deliverable now: merging a
        waiting message would let its causal successors overtake its predecessors. The link
        entry becomes ``seq`` (the messages delivered on the link), not the stamp's count of
        the event's messages: the later siblings are still to be delivered.
        """
        decoded = self._decoded(src, stamp)
        # The verdict itself is always recomputed: the clock may have moved since check().
        verdict = self._verdict(src, decoded, seq)
        if verdict is not Verdict.DELIVER:
            raise ClockError(
                f"refusing to deliver a message from {src}: its verdict is {verdict.name}"
            )
        self._merge(src, decoded, seq)

    def deliver_event(self, src: int, stamp: bytes, first: int, last: int) -> None:
        """Deliver messages ``first..last`` of one event on the link from ``src`` (siblings: all
        carry ``stamp``) in one merge; the clock ends as :meth:`deliver` of each, in order,
        would leave it.

        Refuses (ClockError, clock untouched) unless ``first`` is deliverable now and ``last``
        is within the event (at most the stamp's link counter). One merge is enough: the first
        merge takes every cell of the stamp, and the ones after it change only the link entry.
        """
        decoded = self._decoded(src, stamp)
        if not first <= last <= decoded.link:
            raise ClockError(
                f"messages {first}..{last} from {src} are not within an event of {decoded.link}"
            )
        verdict = self._verdict(src, decoded, first)
        if verdict is not Verdict.DELIVER:
            raise ClockError(
                f"refusing to deliver messages from {src}: the first one's verdict is "
                f"{verdict.name}"
            )
        self._merge(src, decoded, last)

    def receive(self, src: int, stamp: bytes, seq: int | None = None) -> Verdict:
        """:meth:`check`, then :meth:`deliver` when the verdict is DELIVER, decoding once."""
        decoded = self._decoded(src, stamp)
        verdict = self._verdict(src, decoded, seq)
        if verdict is Verdict.DELIVER:
            self._merge(src, decoded, seq)
        return verdict

    def event_end(self, src: int, stamp: bytes) -> int:
        """The seq of the last message the event that sent ``stamp`` sent to this server.

        That is the stamp's link counter. A message whose own seq is lower has later siblings
        on its link, sent in the same event (:meth:`prepare_sends`): it must be delivered in
        one go with them, so that nothing done after it can precede them.
        """
        return self._decoded(src, stamp).link

    def _decoded(self, src: int, stamp: bytes) -> _Parsed:
        """``stamp`` validated completely, taken apart for the verdict and the merge.

        Everything that can be wrong with it is found here, before any verdict, so that a
        malformed stamp is always an error (never a DUPLICATE or a WAIT that hides it). Two
        parts: :meth:`_parse`, a function of the bytes and the link alone, and
        :meth:`_check_ahead`, which reads the clock. The parse of the last stamp seen is
        remembered (volatile, not clock state): the receive path asks about one message several
        times (event_end, check, deliver), and the siblings of an event on one link carry equal
        stamps (:meth:`prepare_sends`), so a burst of n messages is parsed once, not ~4n times.
        The check against the clock is redone on every call: an aborted transaction may have
        rolled the clock back since.
        """
        try:
            seen, seen_src, parsed = self._v_parsed
        except AttributeError:
            seen = None
        # Equal bytes, not the same object: each frame brings its own copy of a shared stamp.
        if seen is None or seen_src != src or seen != stamp:
            parsed = self._parse(src, stamp)
            self._v_parsed = (bytes(stamp), src, parsed)
        if parsed.own:
            self._check_ahead(src, parsed.own)
        return parsed

    def _parse(self, src: int, stamp: bytes) -> _Parsed:
        """Everything :meth:`_decoded` checks that depends on the bytes only; their parts."""
        mode, k, me, *_ = self._fast()
        if not 0 <= src < k or src == me:
            raise ClockError(
                f"message source {src} is not another server of this domain (0..{k - 1}, me={me})"
            )
        if len(stamp) < HEADER_SIZE:
            raise ClockError(f"stamp of {len(stamp)} bytes is shorter than its header")
        version, kind, size, hsrc, hdest = _HEADER.unpack_from(stamp)
        if version != STAMP_VERSION:
            raise ClockError(f"stamp format version {version} unknown (expected {STAMP_VERSION})")
        if kind != _MODE_KIND[mode]:
            raise ClockError(
                f"stamp encoding {_KIND_NAMES.get(kind, kind)!r} but this domain uses "
                f"{_KIND_NAMES[_MODE_KIND[mode]]!r}"
            )
        if size != k:
            raise ClockError(f"stamp is for a domain of {size} servers, this one has {k}")
        if hsrc != src or hdest != me:
            raise ClockError(
                f"stamp is for the link {hsrc}->{hdest} but was presented on {src}->{me}"
            )
        link_key = src * k + me
        matrix: array[int] | None = None
        if kind == KIND_FIFO:
            if len(stamp) != _FIFO_STAMP.size:
                raise ClockError(f"fifo stamp of {len(stamp)} bytes, expected {_FIFO_STAMP.size}")
            return _Parsed(_FIFO_BODY.unpack_from(stamp, HEADER_SIZE)[0], (), (), (), None)
        if kind == KIND_DELTA:
            n, rest = divmod(len(stamp) - HEADER_SIZE, _ENTRY_SIZE)
            if rest or n == 0:
                raise ClockError(
                    f"delta stamp body of {len(stamp) - HEADER_SIZE} bytes is not a non-empty "
                    f"sequence of {_ENTRY_SIZE}-byte entries"
                )
            flat = _delta_struct(n).unpack(stamp)[5:]
            keys = flat[0::2]
            if max(keys) >= k * k:
                bad = max(keys)
                raise ClockError(f"delta stamp entry ({bad // k}, {bad % k}) is outside the matrix")
            if link_key not in keys:
                raise ClockError(f"delta stamp lacks the counter of the link {src}->{me}")
            entries = tuple(zip(keys, flat[1::2], strict=True))
            link = entries[keys.index(link_key)][1]
        else:
            expected = HEADER_SIZE + 8 * k * k
            if len(stamp) != expected:
                raise ClockError(f"full stamp of {len(stamp)} bytes, expected {expected}")
            matrix = array("q")
            matrix.frombytes(memoryview(stamp)[HEADER_SIZE:])
            if _BIG_ENDIAN:
                matrix.byteswap()
            link = matrix[link_key]
            # Only non-zero cells can ever exceed ours: the verdict and the check skip the rest.
            entries = tuple((key, value) for key, value in enumerate(matrix) if value)
        return _Parsed(
            link,
            entries,
            tuple(e for e in entries if e[0] % k == me and e[0] != link_key),
            tuple(e for e in entries if e[0] // k == me),
            matrix,
        )

    def _check_ahead(self, src: int, own: tuple[tuple[int, int], ...]) -> None:
        """Refuse a stamp whose row ``me`` (``own``) is ahead of this clock.

        Nobody can know of more sends of ours than we made: if a stamp says so, our store has
        lost committed transactions (or the stamp is garbage). Merging it would make us skip
        sequence numbers and stall our receivers.
        """
        for key, value in own:
            if value > self._value(key):
                k = self.size
                raise ClockError(
                    f"stamp from {src} says {self.me} sent {value} messages to {key % k}, but "
                    f"it sent {self.entry(self.me, key % k)}: this server's store is behind the "
                    "domain"
                )

    def _value(self, key: int) -> int:
        """``H[a][b]`` for ``key = a*k + b`` of a causal clock (fifo stamps carry no entries)."""
        mode, _k, _me, pages, bits, mask = self._fast()
        if mode == _DELTA_CAUSAL:
            return pages[key >> bits].d[(key & mask) * _STRIDE]
        return self._m[key]

    def _verdict(self, src: int, parsed: _Parsed, seq: int | None) -> Verdict:
        count = parsed.link
        if seq is None:
            seq = count
        elif not 1 <= seq <= count:
            raise ClockError(
                f"message {seq} from {src} carries a stamp that counts {count} messages on its "
                "link: the sequence number must be between 1 and that count"
            )
        mode, k, me, pages, bits, mask = self._fast()
        if mode == _DELTA_CAUSAL:  # the hot case, read directly: entry() checks its arguments
            link_key = src * k + me
            have = pages[link_key >> bits].d[(link_key & mask) * _STRIDE]
        else:
            have = self.entry(src, me)
        if seq <= have:
            return Verdict.DUPLICATE
        if seq != have + 1:
            return Verdict.WAIT
        # Deliverable when we hold every message sent to us that the sender knew of.
        for key, value in parsed.column:
            if value > self._value(key):
                return Verdict.WAIT
        return Verdict.DELIVER

    def _merge(self, src: int, parsed: _Parsed, seq: int | None) -> None:
        mode, k, me, pages, bits, mask = self._fast()
        link_key = src * k + me
        # The link entry becomes the messages delivered on the link, not those of the event:
        # its later siblings are still to come.
        link = parsed.link if seq is None else seq
        if mode == _DELTA_CAUSAL:
            sentinel = k * k
            epoch = self._next_epoch(pages, bits, mask, sentinel)[2]
            for key, value in parsed.entries:
                if key == link_key:
                    value = link
                if value > pages[key >> bits].d[(key & mask) * _STRIDE]:
                    self._change(pages, bits, mask, sentinel, key, value, src, epoch)
        elif mode == _FULL_CAUSAL:
            # The baseline's O(k^2) merge, and a rewrite of the whole record at commit.
            self._touch(self)  # before the assignment below marks it changed behind our back
            merged = array("q", map(max, self._m, parsed.matrix))  # type: ignore[arg-type]
            merged[link_key] = link
            self._m = merged
        elif mode == _DELTA_FIFO:
            page = pages[src >> bits]
            page.d[(src & mask) * 2 + _IN] = link
            self._touch(page)
        else:
            self._m[link_key] = link
            self._touch(self)

    def dirty_bytes(self) -> int:
        """Estimate of the bytes the next commit will write for this clock (0 when unchanged).

        Sums the size of the records changed in the current transaction, from ZODB's own
        estimate of each record's size (``_p_estimated_size``, set when it was last loaded or
        stored) or the known layout of records never stored. No pickling.
        """
        if self._p_jar is None or self._p_serial == _NEVER_STORED:
            return sum(self._estimate(p) for p in self._pieces())
        touched: dict[int, persistent.Persistent] | None = getattr(self, "_v_touched", None)
        if not touched:
            return 0
        total = 0
        for oid, piece in list(touched.items()):
            if piece._p_changed:
                total += piece._p_estimated_size or self._estimate(piece)
            else:  # committed or rolled back since it was touched
                del touched[oid]
        return total

    def _touch(self, piece: persistent.Persistent) -> None:
        """Mark ``piece`` (a page or the clock itself) as changed.

        Records it for :meth:`dirty_bytes`. Hot paths test ``_p_changed`` before calling.
        """
        if not piece._p_changed:
            piece._p_changed = True
            touched: dict[int, persistent.Persistent] | None = getattr(self, "_v_touched", None)
            if touched is None:
                touched = {}
                self._v_touched = touched
            touched[id(piece)] = piece

    def _pieces(self) -> list[persistent.Persistent]:
        pieces: list[persistent.Persistent] = [self]
        if self._mode in (_DELTA_CAUSAL, _DELTA_FIFO):
            pieces += self._pages
        return pieces

    def _estimate(self, piece: persistent.Persistent) -> int:
        if isinstance(piece, _Page):
            return 8 * len(piece.d) + _RECORD_OVERHEAD
        # The clock record: the matrix in full mode, a reference per page in delta mode.
        if self._mode in (_FULL_CAUSAL, _FULL_FIFO):
            return 8 * self.size * self.size + _RECORD_OVERHEAD
        return _RECORD_OVERHEAD + 40 * len(self._pages)


def _delta_entries(
    pages: Any, bits: int, mask: int, sentinel: int, head: int, before: int, dest: int, k: int
) -> list[int]:
    """The (key, value) pairs, flattened, that a delta stamp to ``dest`` carries: the entries
    on the changed list from ``head`` whose tags are newer than ``before`` (the list is in
    change order, newest first, so the walk stops at the first older one), less those ``dest``
    itself changed or that are about ``dest``'s own row."""
    flat: list[int] = []
    x = head
    while x != sentinel:
        d = pages[x >> bits].d
        i = (x & mask) * _STRIDE
        tag = d[i + _TAG]
        if tag <= before:
            break
        if tag & _SRC_MASK != dest and x // k != dest:
            flat.append(x)
            flat.append(d[i])
        x = d[i + _LIST] >> 32
    return flat
