"""Asynchronous data parallelism over MPI one-sided communication (``training.mode: async``).

Synchronous training (training.distributed) ends every step in an allreduce, so every rank
waits for the slowest one at every step. Here the ranks share one copy of the training state in
an MPI window and wait for each other only to keep the staleness of gradients bounded.

Where the state lives
    One window, allocated on rank 0 (the *host*, which trains like every other rank), holds the
    weights W (P floats), the optimiser's state (Adam's moments or SGD's momentum, Q floats; its
    step count in a control word), a gradient accumulator A (P + 3 floats: gradient sum, loss
    sum, weight sum, batch slots) and a few control words. One host rather than weights striped
    over the ranks: an update reads and writes the optimiser state of every tensor (LARC needs
    whole-tensor norms) under one mutual exclusion, which striping would turn into one lock per
    stripe. The price is that the host's memory (its network link, across nodes) carries every
    rank's traffic: per batch 2 P floats (the contribution, the new W read back), per update up
    to 2 P + 2 Q more (W and the state read if the applying rank lacks them, and written).

A step of rank r, computing on weights of version v
    1. the gradient of its batch's weighted loss sum, computed locally (as in sync);
    2. *contribute*: add gradient, loss sum, weight sum and batch size into A (Accumulate; an
       empty A is overwritten, and the rank about to apply A reads it and adds locally);
    3. once A holds a global batch's worth of samples (batch_size x ranks, from whichever ranks),
       the rank that completed it *applies* A, if the staleness bound allows: it reads the
       optimiser state and A, runs the Keras optimiser on A's gradient sum over its weight sum
       (the synchronous step's arithmetic), writes W and the state back, marks A empty and
       increments the version. Each update therefore has the size of a synchronous step, and
       there are as many per epoch ("K-batch-async" SGD with K = ranks: Dutta et al., AISTATS
       2018): a fast rank simply contributes more of each update;
    4. the rank continues on the current W (read with Get if the version changed). It waits only
       where step 3 is held back by the bound, and, with max_staleness 0, after every
       contribution. No step has a barrier.

Bounded staleness (``training.max_staleness`` = s)
    A gradient computed on version v and applied to version t is t - v updates stale. The update
    t -> t + 1 may happen only if every rank k still computing a gradient, on version v_k, keeps
    t + 1 - v_k <= s; a pending gradient is applied by the next update, so none is ever applied
    more than s updates late. A rank that completes a global batch the bound holds back waits
    until the update is allowed (it then applies it) or done by another rank. Waiting and
    finished ranks do not hold updates back, and when no rank is computing, a waiting rank applies
    what A holds, so the ranks never all wait. With s = 0 every rank waits after contributing, an
    update takes every rank's gradient of the same version and applies their sum: the
    synchronous step (tests/test_training_async.py compares the weights after an epoch).

Optimiser state
    The optimiser runs where the update happens, on the state it reads from the window (unless
    that rank applied the previous update and still holds it), and writes the state back before
    releasing the mutex: updates happen one after another, each on the state the previous left, as
    one sequential optimiser on the sequence of summed gradients. Its learning rate is evaluated,
    as in sync, at the training position counted in global batches of samples applied so far;
    an update carrying fewer samples than a global batch (the last of an epoch) takes a step
    scaled by its share. With s = 0 that is exactly the synchronous schedule. (Checked with a
    trace of a 2-rank run: the weights every gradient was computed on are the ones published
    for its version, each update's gradient sum is the sum of its contributions, and the state
    an applying rank holds equals the window's.)

Staleness costs convergence, per update
    Allowing staleness does not change the number or the size of the updates, but on 2 ranks
    about half of each update's gradient was computed on the weights before the previous update
    (staleness mean 0.46, max 1). On the benchmark's problem (bench/async.py: MLPerf network,
    Adam 5e-4, 2 x 16 samples, 10 epochs, seed 1) that takes the training loss to 0.131 where
    sync reaches 0.055. A single-process emulation of exactly this arithmetic (one rank's half
    of every update one update stale) gives 0.118 against 0.050 for its synchronous twin, so
    the gap is the staleness itself: one Adam step of this network turns a batch's gradient by
    a lot (cosine between its gradients before and after one update 0.47 in the first epoch,
    0.56-0.86 later; two different batches on the same weights: 0.40-0.73). In the emulation,
    standard remedies did not close the gap: weighting a stale gradient by 1 / (1 + staleness)
    0.111, half the learning rate 0.113 (sync at half the rate: 0.081), Adam beta_1 0.5 0.145,
    delay compensation (DC-ASGD, Adam-normalised, lambda 2) 0.143; dropping the stale half
    altogether 0.083. None is applied here. Nor did synchronous first epochs help (an emulation
    with a half-speed straggler, three seeds, validation loss after 10 epochs: async 0.23-0.25,
    sync for the first epoch 0.19-0.24, for two 0.20-0.24, sync throughout 0.16-0.19). SGD with
    momentum 0.9 loses nothing to staleness at the rate of 0.01 (0.23-0.24 either way), where it
    learns slowly, but does at 0.1 (0.27 against 0.19-0.21), and less momentum (0.8, 0.7) only
    slowed it: staleness caps the rate at which this network can learn. Async pays off only
    where waiting for stragglers costs more than that (docs/stage-reference.md, "Asynchronous training").

Only one-sided operations, under one passive-target epoch
    MPICH grants ``MPI_Win_lock`` in the target's progress engine, so a rank locking the host's
    window waits until the host next calls MPI: a hidden synchronisation with the host (here a
    lock waited 3 s for a host that slept 3 s). Every rank therefore opens one passive-target
    epoch (``Lock_all``) for the whole run, and mutual exclusion is a spin lock on a word of the
    window (``Compare_and_swap``, released with ``Accumulate(REPLACE)``). Control words are read
    with ``Get_accumulate(NO_OP)`` and written with ``Accumulate(REPLACE)``, so that each is
    atomic; bulk data moves with ``Get``, ``Put`` and ``Accumulate`` while the mutex is held, and
    everything is flushed before it is released. Within a node these are loads and
    stores in shared memory that need nothing from the host; across nodes MPICH may need the
    host's progress engine for them (docs/stage-reference.md, "Asynchronous training").

Work per epoch
    With s = 0 the ranks read the synchronous shards (training.pipeline), padding included.
    Otherwise the epoch's files, in the same seeded order, are handed out by a counter in the
    window (``Fetch_and_op``): rank r starts with file r, then claims the next unclaimed one
    whenever its input pipeline needs a file, so a faster rank reads more files and every sample
    is still used exactly once per epoch (checked at every epoch's end). Every epoch ends with
    barriers around the last (partial) update, after which every rank reads the final weights
    and optimiser state: validation, checkpoints and history see the shared state, as in sync.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import time
from typing import Sequence

import keras
import numpy as np

from training.distributed import summed_loss_gradients
from training.mpi import AllRanksError, SerialCommunicator
from training.pipeline import TrainingPlan, epoch_dataset, epoch_file_order
from workflow.errors import PipelineError

log = logging.getLogger(__name__)

HOST = 0  # the rank whose memory holds the window
NONE = -1  # READ of a rank that is not computing
NO_VERSION = np.iinfo(np.int64).max  # PENDING_VMIN while nothing is pending

# Control words (int64) at the start of the window. MUTEX is only touched atomically
# (Compare_and_swap, Accumulate REPLACE); the *block* of words from VERSION up to the claim
# counters is read and written whole while the mutex is held; CLAIMS (one per epoch) only with
# Fetch_and_op.
(MUTEX, VERSION, PENDING_SLOTS, PENDING_N, PENDING_VSUM, PENDING_VMIN, TOTAL_SLOTS, GRADIENTS,
 STALENESS_SUM, STALENESS_MAX, UPDATES, LAST_APPLIER) = range(12)
BLOCK_START, FIXED_WORDS = VERSION, 12

# What a rank does after contributing (returned to the training step's graph).
KEEP, RELOAD, APPLY = 0, 1, 2

# Waiting ranks poll with exponential back-off between these intervals (seconds).
POLL_FIRST_S, POLL_LONGEST_S = 5e-5, 2e-3


@dataclasses.dataclass(frozen=True)
class WindowLayout:
    """Where the training state lies in the window (see "Where the state lives" above).

    First int64 words: the ``FIXED_WORDS`` control words, the optimiser's ``n_ints`` int64
    values, each rank's READ (the version it computes on, ``NONE`` when it is not computing) and
    WAITING flag, and one claim counter per epoch; a rank keeps a local copy of the *block* (the
    words from ``BLOCK_START`` up to the claim counters). Then, from the next 64-byte boundary,
    float32: the weights W (P floats), the optimiser's state (Q floats) and the accumulator A
    (P + 3 floats: gradient sum, loss sum, weight sum, batch slots). W and A's gradient sum hold
    the trainable variables at ``weight_offsets``, the state its variables at ``state_offsets``
    (in floats; each ends with the total, P or Q).
    """

    weight_shapes: tuple[tuple[int, ...], ...]
    state_shapes: tuple[tuple[int, ...], ...]
    weight_offsets: tuple[int, ...]
    state_offsets: tuple[int, ...]
    n_epochs: int
    ints_at: int  # word offsets: the optimiser's int64 values,
    read_at: int  # each rank's READ,
    waiting_at: int  # each rank's WAITING flag,
    claims_at: int  # each epoch's claim counter
    weights_at: int  # byte offsets: W,
    state_at: int  # the optimiser's state,
    sums_at: int  # A
    size: int  # bytes of the window

    @classmethod
    def of(cls, weight_shapes: Sequence, state_shapes: Sequence, n_ints: int, n_ranks: int,
           n_epochs: int) -> WindowLayout:
        """The layout for trainable variables and optimiser float32 variables of these shapes,
        ``n_ints`` optimiser int64 values, ``n_ranks`` ranks and ``n_epochs`` claim counters."""
        weight_shapes = tuple(tuple(int(d) for d in shape) for shape in weight_shapes)
        state_shapes = tuple(tuple(int(d) for d in shape) for shape in state_shapes)
        weight_offsets = tuple(itertools.accumulate((math.prod(s) for s in weight_shapes), initial=0))
        state_offsets = tuple(itertools.accumulate((math.prod(s) for s in state_shapes), initial=0))
        ints_at = FIXED_WORDS
        read_at = ints_at + n_ints
        waiting_at = read_at + n_ranks
        claims_at = waiting_at + n_ranks
        weights_at = -(-8 * (claims_at + n_epochs) // 64) * 64  # the next 64-byte boundary
        state_at = weights_at + 4 * weight_offsets[-1]
        sums_at = state_at + 4 * state_offsets[-1]
        return cls(weight_shapes, state_shapes, weight_offsets, state_offsets, n_epochs,
                   ints_at, read_at, waiting_at, claims_at, weights_at, state_at, sums_at,
                   size=sums_at + 4 * (weight_offsets[-1] + 3))

    @property
    def P(self) -> int:
        """Floats of the weights."""
        return self.weight_offsets[-1]

    @property
    def Q(self) -> int:
        """Floats of the optimiser's state."""
        return self.state_offsets[-1]

    @property
    def block_words(self) -> int:
        """Words of the block."""
        return self.claims_at - BLOCK_START

    # -- words of a block (a local copy of the window's block) ----------------------------------
    @staticmethod
    def get(block: np.ndarray, word: int) -> int:
        return int(block[word - BLOCK_START])

    @staticmethod
    def set(block: np.ndarray, word: int, value: int) -> None:
        block[word - BLOCK_START] = value

    def ints(self, block: np.ndarray) -> np.ndarray:
        return block[self.ints_at - BLOCK_START:self.read_at - BLOCK_START]

    def reads(self, block: np.ndarray) -> np.ndarray:
        return block[self.read_at - BLOCK_START:self.waiting_at - BLOCK_START]

    def waiting(self, block: np.ndarray) -> np.ndarray:
        return block[self.waiting_at - BLOCK_START:self.claims_at - BLOCK_START]

    # -- local copies of the float32 regions ----------------------------------------------------
    def weight_views(self, weights: np.ndarray) -> list[np.ndarray]:
        """Each trainable variable's view of ``weights`` (P floats: W, A's gradient sum)."""
        return _views(weights, self.weight_offsets, self.weight_shapes)

    def state_views(self, state: np.ndarray) -> list[np.ndarray]:
        """Each optimiser variable's view of ``state`` (Q floats)."""
        return _views(state, self.state_offsets, self.state_shapes)


class SharedState:
    """The training state in an MPI window on rank ``HOST``, and the operations on it.

    Collective to create (every rank of ``comm``) and to :meth:`free`. ``weight_shapes`` and
    ``state_shapes``: the trainable variables' and the optimiser's float32 variables' shapes;
    ``n_ints`` int64 optimiser values (its step count); ``n_epochs`` claim counters (the window
    they make: :class:`WindowLayout`).
    ``slots_per_update`` is the global batch (batch_size x ranks), ``slots_per_epoch`` the batch
    slots of one epoch, ``steps_per_epoch`` the synchronous steps of one (the schedule's unit).
    """

    def __init__(self, comm, weight_shapes: Sequence, state_shapes: Sequence, n_ints: int,
                 n_epochs: int, max_staleness: int, slots_per_update: int, slots_per_epoch: int,
                 steps_per_epoch: int):
        from mpi4py import MPI

        self.MPI, self.comm = MPI, comm
        self.rank, self.n_ranks = comm.Get_rank(), comm.Get_size()
        self.max_staleness = max_staleness
        self.slots_per_update, self.slots_per_epoch = slots_per_update, slots_per_epoch
        self.steps_per_epoch = steps_per_epoch
        self.layout = layout = WindowLayout.of(weight_shapes, state_shapes, n_ints, self.n_ranks,
                                               n_epochs)
        self.win = MPI.Win.Allocate(layout.size if self.rank == HOST else 0, disp_unit=1, comm=comm)
        self.win.Lock_all()
        # local buffers, and per-variable views of them
        self.block = np.zeros(layout.block_words, np.int64)
        self._scratch = np.zeros_like(self.block)
        self._word, self._one, self._zero = (np.zeros(1, np.int64), np.ones(1, np.int64),
                                             np.zeros(1, np.int64))
        self._owner = np.full(1, self.rank + 1, np.int64)
        self._weights = np.zeros(layout.P, np.float32)
        self._state = np.zeros(layout.Q, np.float32)
        self._sums = np.zeros(layout.P + 3, np.float32)
        self._update = np.zeros(layout.P, np.float32)
        self.weight_views = layout.weight_views(self._weights)
        self.state_views = layout.state_views(self._state)
        self.update_views = layout.weight_views(self._update)
        self.local_version = 0  # version of this rank's weights
        self._holding = False
        self._sums_held = False  # self._sums holds A's current content (this rank will apply it)
        self.wait_seconds = self.rma_seconds = 0.0
        self.waits = 0

    # -- the block of control words -------------------------------------------------------------
    def _read_block(self) -> np.ndarray:
        """Every block word, each read atomically (a consistent snapshot only under the mutex)."""
        MPI = self.MPI
        self.win.Get_accumulate([self._scratch, MPI.INT64_T], [self.block, MPI.INT64_T], HOST,
                                target=(8 * BLOCK_START, len(self.block), MPI.INT64_T),
                                op=MPI.NO_OP)
        self.win.Flush(HOST)
        return self.block

    def _write_block(self) -> None:
        MPI = self.MPI
        self.win.Accumulate([self.block, MPI.INT64_T], HOST,
                            target=(8 * BLOCK_START, len(self.block), MPI.INT64_T), op=MPI.REPLACE)

    # -- bulk data ------------------------------------------------------------------------------
    def _put(self, offset: int, values: np.ndarray) -> None:
        if values.size:
            self.win.Put([values, self.MPI.FLOAT], HOST,
                         target=(offset, values.size, self.MPI.FLOAT))

    def _get_into(self, offset: int, out: np.ndarray) -> None:
        if out.size:
            self.win.Get([out, self.MPI.FLOAT], HOST, target=(offset, out.size, self.MPI.FLOAT))

    # -- mutual exclusion -----------------------------------------------------------------------
    def _acquire(self) -> None:
        MPI, delay = self.MPI, POLL_FIRST_S
        while True:
            self.win.Compare_and_swap([self._owner, MPI.INT64_T], [self._zero, MPI.INT64_T],
                                      [self._word, MPI.INT64_T], HOST, 8 * MUTEX)
            self.win.Flush(HOST)
            if self._word[0] == 0:
                self._holding = True
                return
            time.sleep(delay)
            delay = min(1.5 * delay, POLL_LONGEST_S)

    def _release(self) -> None:
        MPI = self.MPI
        self.win.Flush(HOST)  # every access made under the mutex is complete at the host
        self.win.Accumulate([self._zero, MPI.INT64_T], HOST, target=(8 * MUTEX, 1, MPI.INT64_T),
                            op=MPI.REPLACE)
        self.win.Flush(HOST)
        self._holding = False

    # -- set-up and tear-down -------------------------------------------------------------------
    def initialise(self, weights: Sequence[np.ndarray], state: Sequence[np.ndarray],
                   ints: np.ndarray, total_slots: int) -> None:
        """Collective: the host writes the starting state (every rank holds the same one)."""
        MPI, layout = self.MPI, self.layout
        if self.rank == HOST:
            block = self.block
            block[:] = 0
            layout.set(block, PENDING_VMIN, NO_VERSION)
            layout.set(block, TOTAL_SLOTS, total_slots)
            layout.ints(block)[:] = ints
            layout.reads(block)[:] = 0  # every rank computes on version 0
            self.win.Put([self._zero, MPI.INT64_T], HOST, target=(8 * MUTEX, 1, MPI.INT64_T))
            self.win.Put([block, MPI.INT64_T], HOST,
                         target=(8 * BLOCK_START, len(block), MPI.INT64_T))
            claims = np.zeros(layout.n_epochs, np.int64)
            if len(claims):
                self.win.Put([claims, MPI.INT64_T], HOST,
                             target=(8 * layout.claims_at, len(claims), MPI.INT64_T))
            for offset, value in zip(layout.weight_offsets, weights):
                self._put(layout.weights_at + 4 * int(offset), np.ascontiguousarray(value, np.float32))
            for offset, value in zip(layout.state_offsets, state):
                self._put(layout.state_at + 4 * int(offset), np.ascontiguousarray(value, np.float32))
            self.win.Flush(HOST)
        self.local_version = 0
        self.comm.Barrier()

    def free(self) -> None:
        """Collective: close the passive-target epoch and free the window."""
        self.win.Unlock_all()
        self.win.Free()

    # -- the update rule ------------------------------------------------------------------------
    def _full(self, block) -> bool:
        """A holds a global batch (or more)."""
        return self.layout.get(block, PENDING_SLOTS) >= self.slots_per_update

    def _bound_allows(self, block) -> bool:
        """The update t -> t + 1 keeps every computing rank within the staleness bound."""
        layout = self.layout
        reads = layout.reads(block)
        computing = reads[reads >= 0]
        return bool(np.all(layout.get(block, VERSION) + 1 - computing <= self.max_staleness))

    def _nobody_computing(self, block) -> bool:
        """No rank can add to A: a waiting rank applies what it holds."""
        layout = self.layout
        return layout.get(block, PENDING_N) > 0 and not np.any(layout.reads(block) >= 0)

    def _may_apply_waiting(self, block) -> bool:
        """A waiting rank applies A once the bound allows, or when no rank is left to add to A."""
        return (self._full(block) and self._bound_allows(block)) or self._nobody_computing(block)

    def _continue_on_current(self, block) -> int:
        """(mutex held) This rank computes next on the current version; Get W if it is new."""
        layout = self.layout
        version = layout.get(block, VERSION)
        layout.reads(block)[self.rank] = version
        if version == self.local_version:
            return KEEP
        self._get_into(layout.weights_at, self._weights)
        self.local_version = version
        return RELOAD

    # -- a step ---------------------------------------------------------------------------------
    def contribute(self, gradients: Sequence[np.ndarray], scalars: np.ndarray) -> int:
        """Add this rank's gradient sums and [loss sum, weight sum, slots] into A.

        Returns APPLY (this rank must apply A now: it holds the mutex; call
        :meth:`fetch_for_update`, then :meth:`publish`), RELOAD (the current weights are in
        :attr:`weight_views`) or KEEP (this rank's weights are current).
        """
        layout = self.layout
        start = time.perf_counter()
        self._acquire()
        block = self._read_block()
        empty = layout.get(block, PENDING_N) == 0
        reads = layout.reads(block)
        version_used = int(reads[self.rank])
        layout.set(block, PENDING_N, layout.get(block, PENDING_N) + 1)
        layout.set(block, PENDING_SLOTS, layout.get(block, PENDING_SLOTS) + int(round(scalars[2])))
        layout.set(block, PENDING_VSUM, layout.get(block, PENDING_VSUM) + version_used)
        layout.set(block, PENDING_VMIN, min(layout.get(block, PENDING_VMIN), version_used))
        reads[self.rank] = NONE
        full = self._full(block)
        if (full and self._bound_allows(block)) or (
                (full or self.max_staleness == 0) and self._nobody_computing(block)):
            # this rank applies A + its contribution: sum them here, A need not be written
            self._add_to_sums(gradients, scalars, read=not empty)
            self._write_block()
            self.rma_seconds += time.perf_counter() - start
            return APPLY
        self._add_to_window(gradients, scalars, replace=empty)
        if self.max_staleness > 0 and not full:
            action = self._continue_on_current(block)  # A is not full yet: go on
            self._write_block()
            self._release()
            self.rma_seconds += time.perf_counter() - start
            return action
        # A is full but the bound holds the update back, or s = 0: wait for the update
        layout.waiting(block)[self.rank] = 1
        self._write_block()
        self._release()
        return self._wait(start)

    def _add_to_sums(self, gradients, scalars, read: bool) -> None:
        """(mutex held) This rank's copy of A (read from the window if ``read``) plus its
        contribution, for the update it is about to apply."""
        layout = self.layout
        if read:
            self._get_into(layout.sums_at, self._sums)
            self.win.Flush(HOST)
        for first, end, gradient in zip(layout.weight_offsets[:-1], layout.weight_offsets[1:],
                                        gradients):
            part = self._sums[int(first):int(end)]
            if read:
                part += gradient.ravel()
            else:
                part[:] = gradient.ravel()
        self._sums[layout.P:] = self._sums[layout.P:] + scalars if read else scalars
        self._sums_held = True

    def _add_to_window(self, gradients, scalars, replace: bool) -> None:
        """(mutex held) A += contribution in the window; an empty A is overwritten (Put)."""
        MPI, layout = self.MPI, self.layout
        op = MPI.REPLACE if replace else MPI.SUM
        for offset, gradient in zip(layout.weight_offsets, gradients):
            if gradient.size:
                self.win.Accumulate([gradient, MPI.FLOAT], HOST,
                                    target=(layout.sums_at + 4 * int(offset), gradient.size, MPI.FLOAT),
                                    op=op)
        self.win.Accumulate([np.ascontiguousarray(scalars, np.float32), MPI.FLOAT], HOST,
                            target=(layout.sums_at + 4 * layout.P, 3, MPI.FLOAT), op=op)

    def _wait(self, start: float) -> int:
        layout = self.layout
        waited = time.perf_counter()
        self.waits += 1
        delay = POLL_FIRST_S
        try:
            while True:
                time.sleep(delay)
                delay = min(1.5 * delay, POLL_LONGEST_S)
                hint = self._read_block()  # word by word, without the mutex
                if layout.waiting(hint)[self.rank] and not self._may_apply_waiting(hint):
                    continue
                self._acquire()
                block = self._read_block()
                if not layout.waiting(block)[self.rank]:  # released by an update
                    action = self._continue_on_current(block)
                    self._write_block()
                    self._release()
                    return action
                if self._may_apply_waiting(block):
                    layout.waiting(block)[self.rank] = 0
                    self._write_block()
                    return APPLY
                self._release()
        finally:
            self.wait_seconds += time.perf_counter() - waited
            self.rma_seconds += waited - start

    def fetch_for_update(self):
        """(mutex held) Read what an update needs.

        Returns (whether to load W, whether to load the optimiser state, the weight views, the
        state views, the update views = A's gradient sum / weight sum, the optimiser's int64
        values, [schedule position in synchronous steps, the update's share of a global batch]).
        W and the state are read only if this rank does not hold them already.
        """
        layout = self.layout
        start = time.perf_counter()
        assert self._holding, "fetch_for_update without the mutex"
        block, P = self.block, layout.P
        load_weights = layout.get(block, VERSION) != self.local_version
        load_state = layout.get(block, LAST_APPLIER) != self.rank + 1
        if load_weights:
            self._get_into(layout.weights_at, self._weights)
        if load_state:
            self._get_into(layout.state_at, self._state)
        if not self._sums_held:
            self._get_into(layout.sums_at, self._sums)
        self.win.Flush(HOST)
        weight_sum = self._sums[P + 1]
        np.divide(self._sums[:P], weight_sum if weight_sum > 0 else np.float32(np.inf),
                  out=self._update)
        schedule = np.array([
            layout.get(block, TOTAL_SLOTS) * self.steps_per_epoch / self.slots_per_epoch,
            float(self._sums[P + 2]) / self.slots_per_update], np.float32)
        self.rma_seconds += time.perf_counter() - start
        return (np.bool_(load_weights), np.bool_(load_state), self.weight_views, self.state_views,
                self.update_views, layout.ints(block).copy(), schedule)

    def publish(self, weights: Sequence[np.ndarray], state: Sequence[np.ndarray],
                ints: np.ndarray) -> None:
        """(mutex held) Write the updated weights and optimiser state, clear A, advance the
        version, release every waiting rank and the mutex."""
        layout = self.layout
        start = time.perf_counter()
        block = self.block
        for offset, value in zip(layout.weight_offsets, weights):
            self._put(layout.weights_at + 4 * int(offset), np.ascontiguousarray(value, np.float32))
        for offset, value in zip(layout.state_offsets, state):
            self._put(layout.state_at + 4 * int(offset), np.ascontiguousarray(value, np.float32))
        self._sums_held = False  # A is empty (PENDING_N = 0): the next contribution overwrites it
        version = layout.get(block, VERSION)
        n = layout.get(block, PENDING_N)
        layout.set(block, GRADIENTS, layout.get(block, GRADIENTS) + n)
        layout.set(block, STALENESS_SUM, layout.get(block, STALENESS_SUM)
                   + n * version - layout.get(block, PENDING_VSUM))
        layout.set(block, STALENESS_MAX, max(layout.get(block, STALENESS_MAX),
                                             version - layout.get(block, PENDING_VMIN)))
        layout.set(block, UPDATES, layout.get(block, UPDATES) + 1)
        layout.set(block, TOTAL_SLOTS,
                   layout.get(block, TOTAL_SLOTS) + layout.get(block, PENDING_SLOTS))
        for word, value in ((PENDING_N, 0), (PENDING_SLOTS, 0), (PENDING_VSUM, 0),
                            (PENDING_VMIN, NO_VERSION), (VERSION, version + 1),
                            (LAST_APPLIER, self.rank + 1)):
            layout.set(block, word, value)
        layout.ints(block)[:] = ints
        reads, waiting = layout.reads(block), layout.waiting(block)
        # waiting ranks compute next on (at least) the new version: count them as computing
        # from now on, so that they are not overtaken before they have read it
        reads[waiting > 0] = version + 1
        waiting[:] = 0
        reads[self.rank] = version + 1
        self.local_version = version + 1
        self._write_block()
        self._release()
        self.rma_seconds += time.perf_counter() - start

    # -- epoch boundaries -----------------------------------------------------------------------
    def stop_computing(self) -> None:
        """This rank has no more batches this epoch (it no longer holds updates back)."""
        self._acquire()
        block = self._read_block()
        self.layout.reads(block)[self.rank] = NONE
        self._write_block()
        self._release()

    def acquire_if_pending(self) -> bool:
        """Take the mutex if A holds gradients (then apply them); else leave it free."""
        self._acquire()
        if self.layout.get(self._read_block(), PENDING_N):
            return True
        self._release()
        return False

    def read_all(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, float]:
        """Weights, optimiser state, its int64 values and the schedule position (flat copies
        of the shared ones); this rank is now computing on their version."""
        layout = self.layout
        self._acquire()
        self._get_into(layout.weights_at, self._weights)
        self._get_into(layout.state_at, self._state)
        block = self._read_block()
        version = layout.get(block, VERSION)
        layout.reads(block)[self.rank] = version
        self._write_block()
        self._release()
        self.local_version = version
        position = layout.get(block, TOTAL_SLOTS) * self.steps_per_epoch / self.slots_per_epoch
        return self._weights, self._state, layout.ints(block).copy(), position

    def claim(self, epoch: int) -> int:
        """The next unclaimed position in ``epoch``'s file order, counted past the first
        ``n_ranks`` (each rank's first file is its own). Safe from another thread."""
        MPI = self.MPI
        result = np.zeros(1, np.int64)
        self.win.Fetch_and_op([self._one, MPI.INT64_T], [result, MPI.INT64_T], HOST,
                              8 * (self.layout.claims_at + epoch), MPI.SUM)
        self.win.Flush(HOST)
        return self.n_ranks + int(result[0])

    def statistics(self) -> dict:
        layout = self.layout
        block = self._read_block()
        gradients = layout.get(block, GRADIENTS)
        return {"updates": layout.get(block, UPDATES), "gradients": gradients,
                "staleness_mean": (layout.get(block, STALENESS_SUM) / gradients
                                   if gradients else None),
                "staleness_max": layout.get(block, STALENESS_MAX) if gradients else None}


class SharedProgressSchedule(keras.optimizers.schedules.LearningRateSchedule):
    """``schedule`` at the shared training position (in synchronous steps), times the share of
    a global batch that the update being applied carries. Both are set before each update."""

    def __init__(self, schedule):
        import tensorflow as tf

        self.schedule = schedule
        self.position = tf.Variable(0.0, trainable=False, dtype=tf.float32, name="shared_position")
        self.scale = tf.Variable(1.0, trainable=False, dtype=tf.float32, name="update_share")

    def __call__(self, step):
        return self.schedule(self.position) * self.scale

    def get_config(self) -> dict:
        return {"schedule": self.schedule.get_config()}


class AsyncDataParallelModel(keras.Model):
    """``network`` trained asynchronously over the ranks of ``comm`` (see the module docstring).

    Compile it with an optimiser made with ``wrap_schedule=model.wrap_schedule``, build the
    optimiser, restore or broadcast the starting state, call :meth:`share` (collective), train
    with :class:`EpochBoundary` as the first callback, and finish with :meth:`close`.
    """

    def __init__(self, network: keras.Model, comm, max_staleness: int, batch_size: int,
                 plan: TrainingPlan, epochs: int, **kwargs):
        super().__init__(name=f"async_data_parallel_{network.name}", **kwargs)
        if isinstance(comm, SerialCommunicator):
            raise PipelineError("training.mode = 'async' needs mpi4py (an MPI window); install "
                                "mpi4py or set training.mode to 'sync'.")
        self.network, self.comm = network, comm
        self.rank, self.n_ranks = comm.Get_rank(), comm.Get_size()
        self.max_staleness, self.batch_size, self.plan, self.epochs = (
            max_staleness, batch_size, plan, epochs)
        self.shared: SharedState | None = None
        self.schedule: SharedProgressSchedule | None = None
        self.epoch, self._epoch_open = 0, False
        self.samples: dict[int, int] = {}
        self.steps: dict[int, int] = {}
        self.claimed: dict[int, list[int]] = {}
        self.epoch_records: list[dict] = []
        self._eager_update = None

    @property
    def claims_files(self) -> bool:
        """Files are handed out as ranks ask (else each rank reads its synchronous shard)."""
        return self.max_staleness > 0 and self.n_ranks > 1

    @property
    def slots_per_epoch(self) -> int:
        if self.claims_files:
            return self.plan.n_samples
        return self.plan.steps_per_epoch * self.batch_size * self.n_ranks

    def wrap_schedule(self, schedule) -> SharedProgressSchedule:
        self.schedule = SharedProgressSchedule(schedule)
        return self.schedule

    def call(self, inputs, training=False):
        return self.network(inputs, training=training)

    # -- state held in the window ---------------------------------------------------------------
    def _optimizer_parts(self) -> tuple[list, list]:
        """The optimiser's variables: (float32 ones, integer ones)."""
        floats, ints = [], []
        for variable in self.optimizer.variables:
            (ints if "int" in str(variable.dtype) else floats).append(variable)
        for variable in floats:
            if str(variable.dtype) != "float32":
                raise PipelineError(f"training.mode = 'async' cannot share optimiser variable "
                                    f"{variable.path} of dtype {variable.dtype}.")
        return floats, ints

    def share(self, start_epoch: int, start_step: int) -> None:
        """Collective: open the window and put this rank's (everywhere equal) state in it."""
        floats, ints = self._optimizer_parts()
        self.shared = SharedState(
            self.comm, [v.shape for v in self.trainable_variables], [v.shape for v in floats],
            len(ints), self.epochs, self.max_staleness,
            slots_per_update=self.batch_size * self.n_ranks, slots_per_epoch=self.slots_per_epoch,
            steps_per_epoch=self.plan.steps_per_epoch)
        total_slots = (start_epoch * self.slots_per_epoch
                       + start_step * self.batch_size * self.n_ranks)
        self.shared.initialise([v.numpy() for v in self.trainable_variables],
                               [v.numpy() for v in floats],
                               np.array([int(v.numpy()) for v in ints], np.int64), total_slots)
        self._set_schedule(total_slots * self.plan.steps_per_epoch / self.slots_per_epoch, 1.0)

    def _set_schedule(self, position: float, scale: float) -> None:
        if self.schedule is not None:
            self.schedule.position.assign(position)
            self.schedule.scale.assign(scale)

    def close(self) -> dict:
        """Collective: free the window; return the run's asynchronous record (for run.json)."""
        shared = self.shared
        statistics = shared.statistics()
        per_rank = self.comm.allgather((shared.wait_seconds, shared.rma_seconds, shared.waits))
        self.comm.Barrier()
        shared.free()
        self.shared = None
        return {
            "max_staleness": self.max_staleness, "host_rank": HOST,
            "files": "claimed" if self.claims_files else "synchronous shards", **statistics,
            "wait_seconds_per_rank": [r[0] for r in per_rank],
            "rma_seconds_per_rank": [r[1] for r in per_rank],
            "waits_per_rank": [r[2] for r in per_rank],
            "epochs": self.epoch_records,
        }

    # -- the training step ----------------------------------------------------------------------
    def train_step(self, data):
        import tensorflow as tf

        gradients, loss_sum, weight_sum = summed_loss_gradients(self, data)
        slots = tf.cast(tf.shape(data[0])[0], tf.float32)
        action = tf.numpy_function(
            self._contribute, [tf.cast(g, tf.float32) for g in gradients]
            + [tf.stack([loss_sum, weight_sum, slots])], tf.int64, stateful=True)
        tf.switch_case(tf.cast(tf.ensure_shape(action, []), tf.int32),
                       [lambda: tf.constant(0), self._load_weights, self._apply_update])
        # this rank's own samples; AverageMetrics weighs the ranks by their sample counts
        self._loss_tracker.update_state(tf.math.divide_no_nan(loss_sum, weight_sum),
                                        sample_weight=weight_sum)
        return {"loss": self._loss_tracker.result()}

    def _contribute(self, *arrays) -> np.int64:
        *gradients, scalars = arrays
        self.samples[self.epoch] = self.samples.get(self.epoch, 0) + int(round(scalars[1]))
        self.steps[self.epoch] = self.steps.get(self.epoch, 0) + 1
        return np.int64(self.shared.contribute(gradients, scalars))

    def _load_weights(self):
        """(graph) Assign the weights that :meth:`SharedState.contribute` read."""
        import tensorflow as tf

        values = tf.numpy_function(lambda: self.shared.weight_views, [],
                                   [tf.float32] * len(self.trainable_variables), stateful=True)
        for variable, value in zip(self.trainable_variables, values):
            variable.assign(tf.reshape(value, variable.shape))
        return tf.constant(1)

    def _apply_update(self):
        """(graph; this rank holds the mutex) Load what it lacks of the shared state, apply the
        accumulated gradient with the optimiser, publish the result."""
        import tensorflow as tf

        floats, ints = self._optimizer_parts()
        trainable = self.trainable_variables
        n_w, n_s = len(trainable), len(floats)
        outputs = tf.numpy_function(
            lambda: _fetch_flat(self.shared), [],
            [tf.bool, tf.bool] + [tf.float32] * (2 * n_w + n_s) + [tf.int64, tf.float32],
            stateful=True)
        load_weights, load_state = outputs[0], outputs[1]
        weights, state = outputs[2:2 + n_w], outputs[2 + n_w:2 + n_w + n_s]
        update = outputs[2 + n_w + n_s:2 + 2 * n_w + n_s]
        int_values = tf.ensure_shape(outputs[-2], [len(ints)])
        schedule = tf.ensure_shape(outputs[-1], [2])

        def assign(variables, values):
            def run():
                for variable, value in zip(variables, values):
                    variable.assign(tf.reshape(value, variable.shape))
                return tf.constant(True)
            return run

        unchanged = lambda: tf.constant(False)  # noqa: E731
        tf.cond(tf.ensure_shape(load_weights, []), assign(trainable, weights), unchanged)
        tf.cond(tf.ensure_shape(load_state, []), assign(floats, state), unchanged)
        for index, variable in enumerate(ints):
            variable.assign(tf.cast(int_values[index], variable.dtype))
        self.schedule.position.assign(schedule[0])
        self.schedule.scale.assign(schedule[1])
        self.optimizer.apply_gradients(zip(
            [tf.reshape(u, v.shape) for u, v in zip(update, trainable)], trainable))
        new_ints = (tf.stack([tf.cast(v, tf.int64) for v in ints]) if ints
                    else tf.zeros([0], tf.int64))
        tf.numpy_function(lambda *a: _publish_flat(self.shared, n_w, n_s, a),
                          list(trainable) + list(floats) + [new_ints], tf.bool, stateful=True)
        return tf.constant(2)

    # -- epochs ---------------------------------------------------------------------------------
    def begin_epoch(self, epoch: int) -> None:
        self.epoch, self._epoch_open = epoch, True
        self.samples.setdefault(epoch, 0)
        self.steps.setdefault(epoch, 0)

    def end_epoch(self) -> None:
        """Collective, once per epoch after its last step: wait until every rank is done, apply
        what A still holds, then load the shared weights and optimiser state everywhere."""
        import tensorflow as tf

        if not self._epoch_open:
            return
        self._epoch_open = False
        shared = self.shared
        shared.stop_computing()
        self.comm.Barrier()  # every rank has contributed its last batch
        if self.rank == HOST and shared.acquire_if_pending():
            if self._eager_update is None:
                self._eager_update = tf.function(self._apply_update)
            self._eager_update()
        self.comm.Barrier()  # every update of the epoch is applied
        weights, state, ints, position = shared.read_all()
        floats, int_variables = self._optimizer_parts()
        _assign_flat(self.trainable_variables, weights)
        _assign_flat(floats, state)
        for variable, value in zip(int_variables, ints):
            variable.assign(value)
        self._set_schedule(position, 1.0)
        self.comm.Barrier()  # nobody updates in the next epoch before every rank has read this one
        self._record_epoch()

    def _record_epoch(self) -> None:
        epoch = self.epoch
        gathered = self.comm.allgather((self.samples[epoch], self.steps[epoch],
                                        self.claimed.get(epoch)))
        record = {"epoch": epoch, "samples": [g[0] for g in gathered],
                  "steps": [g[1] for g in gathered]}
        if self.claims_files:
            claimed = [g[2] or [] for g in gathered]
            record["files"] = [len(c) for c in claimed]
            every = sorted(i for c in claimed for i in c)
            if every != list(range(len(self.plan.file_samples))):
                raise AllRanksError(
                    f"asynchronous training read the training files {every} in epoch {epoch}, "
                    f"not each of the {len(self.plan.file_samples)} once (a bug: please report it)."
                )
            if sum(record["samples"]) != self.plan.n_samples:
                raise AllRanksError(
                    f"asynchronous training used {sum(record['samples'])} samples in epoch "
                    f"{epoch}, not the {self.plan.n_samples} of the split (a bug: please report "
                    f"it)."
                )
        self.epoch_records.append(record)

    def samples_of(self, epoch: int) -> int:
        """Real samples this rank trained on in ``epoch`` (weights of AverageMetrics)."""
        return self.samples.get(epoch, 0)

    def files_of(self, epoch: int) -> list[int]:
        """Indices of the training files this rank claimed in ``epoch``."""
        return list(self.claimed.get(epoch, []))

    def claimed_dataset(self, manifest, split: str, epoch: int, seed: int, shuffle_buffer: int,
                        augment: bool):
        """This rank's batches of ``epoch``: its first file, then files claimed one at a time
        from the shared counter as its input pipeline asks for them (last batch may be short)."""
        import tensorflow as tf

        files = manifest.files_of(split)
        order = epoch_file_order(len(files), seed, epoch)
        names = [str(files[i]) for i in order]
        claimed = self.claimed.setdefault(epoch, [])
        shared, rank = self.shared, self.rank
        position = rank  # this rank's first file, then each one it claims

        def claim_next() -> np.bytes_:
            """The next file's name (b"" once the epoch's files are all claimed)."""
            nonlocal position
            if position >= len(order):
                return np.bytes_(b"")
            claimed.append(int(order[position]))
            name, position = names[position], shared.claim(epoch)
            return np.bytes_(name.encode())

        # A numpy_function in a sequential map, not Dataset.from_generator: with the generator
        # a step of the benchmark's network (bench/async.py) took ~20 ms longer before its
        # gradient was ready (80-88 ms against 58-72, AMD EPYC, 2 ranks on a core each).
        paths = (tf.data.Dataset.range(len(order))
                 .map(lambda _: tf.numpy_function(claim_next, [], tf.string, stateful=True))
                 .take_while(lambda name: tf.strings.length(name) > 0))
        samples = epoch_dataset(manifest, self.plan, split, epoch, rank, seed, shuffle_buffer,
                                augment, claimed_files=paths)
        # No prefetching: what a rank has read ahead is work it has claimed, which a slow rank
        # finishes alone at the epoch's end while the others wait (with one batch prefetched,
        # a 2-rank benchmark epoch with a half-speed straggler ended in a 0.53 s wait instead of
        # 0.40 s), and a rank bound to one core gains little from reading ahead. So tf.data
        # must not grow or inject buffers either.
        options = tf.data.Options()
        options.autotune.enabled = False
        options.experimental_optimization.inject_prefetch = False
        return samples.batch(self.batch_size).with_options(options)


class EpochBoundary(keras.callbacks.Callback):
    """Ends each epoch of an :class:`AsyncDataParallelModel` before validation (or, without
    validation, before the other callbacks' ``on_epoch_end``). Must be the first callback."""

    def __init__(self, model: AsyncDataParallelModel):
        super().__init__()
        self.async_model = model

    def on_epoch_begin(self, epoch, logs=None):
        self.async_model.begin_epoch(epoch)

    def on_test_begin(self, logs=None):
        self.async_model.end_epoch()

    def on_epoch_end(self, epoch, logs=None):
        self.async_model.end_epoch()


class StragglerDelay(keras.callbacks.Callback):
    """Tests and benchmarks only (training.settings.STRAGGLER_DELAY_VARIABLE): sleep after every
    training step, making this rank a straggler."""

    def __init__(self, seconds: float):
        super().__init__()
        self.seconds = seconds

    def on_train_batch_end(self, batch, logs=None):
        time.sleep(self.seconds)


def _views(buffer: np.ndarray, offsets: Sequence[int], shapes: Sequence) -> list[np.ndarray]:
    return [buffer[a:b].reshape(shape) for a, b, shape in zip(offsets[:-1], offsets[1:], shapes)]


def _fetch_flat(shared: SharedState) -> list:
    """:meth:`SharedState.fetch_for_update` as one list; what need not be loaded is empty (the
    graph's branch that would assign it does not run)."""
    load_weights, load_state, weights, state, update, ints, schedule = shared.fetch_for_update()
    empty = np.zeros(0, np.float32)
    weights = weights if load_weights else [empty] * len(weights)
    state = state if load_state else [empty] * len(state)
    return [load_weights, load_state, *weights, *state, *update, ints, schedule]


def _publish_flat(shared: SharedState, n_weights: int, n_state: int, arrays) -> np.bool_:
    shared.publish(arrays[:n_weights], arrays[n_weights:n_weights + n_state], arrays[-1])
    return np.bool_(True)


def _assign_flat(variables: Sequence, values: np.ndarray) -> None:
    offset = 0
    for variable in variables:
        size = int(np.prod(variable.shape))
        variable.assign(values[offset:offset + size].reshape(variable.shape))
        offset += size
