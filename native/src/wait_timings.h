// How every keras_dist wait waits: the shm engine's waits here in C++, and the
// Python waits on MPI requests (keras_dist/_runtime/liveness.py, which reads
// these values from keras_dist._native.WAIT_TIMINGS). Defined once, here.
//
// A wait goes through three phases, measured from when it starts:
//   1. spin:  poll without giving up the core, until kSpinSeconds;
//   2. yield: poll, giving the core to any other runnable thread between
//             polls (sched_yield / time.sleep(0)), until kYieldSeconds;
//   3. block: sleep between polls. The engine blocks in a futex on the step
//             counter of a missing peer, which that peer's publish wakes at
//             once, for at most kFutexWaitSeconds per round; Python cannot be
//             woken by an MPI request, so it sleeps kPollSleepSeconds between
//             polls.
// Every kLivenessSeconds (from the start of phase 2 on) a wait checks that the
// peers it waits for are alive, whether a peer aborted, whether the process
// got a signal, and the stall warning and timeout thresholds
// (KERAS_DIST_STALL_CHECK_SECONDS, KERAS_DIST_TIMEOUT_SECONDS).
//
// Measured on the development machine (AMD EPYC, 2 cores): a pause-and-load
// poll costs 30 ns, an MPI_Test from mpi4py 0.5 us, an idle sched_yield
// 0.77 us, time.sleep(0) 113 us and time.sleep(2e-4) 370 us while a peer
// polls, a liveness check (kill(pid, 0) and /proc/<pid>/stat) 29 us per peer.
#pragma once

namespace kd {

// Peers that enter a collective together arrive within microseconds: a 4-byte
// allreduce on two ranks takes 15 us end to end (keras_dist.bench), so a
// 50 us spin (about 1,700 polls in C++) covers ordinary skew without a system
// call. It matches the engine's earlier 2,000-poll spin (60 us).
inline constexpr double kSpinSeconds = 50e-6;
// Ranks may outnumber cores (tests run 4 ranks on 2 cores): yielding lets an
// awaited peer that shares this core run. Short, because phase 3 wakes on the
// peer's publish anyway; 100 us matches the engine's earlier 50 yields after
// the spin.
inline constexpr double kYieldSeconds = 100e-6;
// Longest futex sleep per round: a publish wakes sleepers at once, so this
// only bounds how late an abort by another rank (which does not wake anyone)
// is noticed: 5 ms, invisible next to the liveness period.
inline constexpr double kFutexWaitSeconds = 5e-3;
// Python's sleep between polls of an MPI request once yielding is over: adds
// at most this (370 us measured) to a wait that already lasted 100 us, and
// keeps a waiting rank at a few percent of a core.
inline constexpr double kPollSleepSeconds = 2e-4;
// A dead peer is named within a tenth of a second, and the checks cost under
// 0.03% of a core per peer (29 us each, ten times a second).
inline constexpr double kLivenessSeconds = 0.1;

}  // namespace kd
