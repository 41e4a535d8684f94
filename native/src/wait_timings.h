// How every keras_dist wait waits: the shm engine's waits here in C++, and the
// Python waits on MPI requests (keras_dist/_runtime/liveness.py, which reads
// these values from keras_dist._native.WAIT_TIMINGS). Defined once, here.
//
// A wait goes through three phases, measured from when it starts:
//   1. spin:  poll without giving up the core, until kSpinSeconds (the
//             engine) or kPythonSpinSeconds (Python's waits);
//   2. yield: poll, giving the core to any other runnable thread between
//             polls (sched_yield / time.sleep(0)), until kYieldSeconds
//             (the engine: kOwnCoreYieldSeconds when every local rank has a
//             CPU of its own);
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

// Peers that enter a collective together arrive within a few microseconds
// when each has a core of its own: a 4-byte allreduce through the one-call
// path takes 2-3 us end to end. When two ranks share one core (more runnable
// processes than cores), the awaited peer cannot run until this rank gives
// the core up, and every poll before the first yield is lost: with a 50 us
// spin each small collective then took the whole spin, ~57 us (both ranks
// pinned to one core with taskset: 57 us per 4-byte allreduce or broadcast
// against MPICH's 8-12 us; the same 57 us mode showed up in unpinned runs on
// the loaded 2-core machine). A 2 us spin (about 64 polls, one clock read)
// covers ordinary skew and then yields: 8.5-9 us per collective on one core
// (5 us spin: 10.5 us), with no loss measured on two free cores
// (benchmarks/results/public_call_latency_np2_*.txt).
inline constexpr double kSpinSeconds = 2e-6;
// Python's waits yield with time.sleep(0), which costs 113 us (not the
// engine's 0.77 us sched_yield): they spin longer before giving the core up,
// 50 us (100 MPI_Tests), as long as a small MPI collective's usual skew.
inline constexpr double kPythonSpinSeconds = 50e-6;
// Ranks may outnumber cores (tests run 4 ranks on 2 cores): yielding lets an
// awaited peer that shares this core run. Short, because phase 3 wakes on the
// peer's publish anyway; 100 us matches the engine's earlier 50 yields after
// the spin.
inline constexpr double kYieldSeconds = 100e-6;
// ...unless every local rank has a CPU of its own (no more local ranks than
// CPUs this process may run on: its affinity mask, and a container's cgroup
// CPU quota if it has one): then nothing else needs this rank's core, and
// a blocked waiter costs the job its wake-up. Measured (2 ranks, 2 cores, the
// ranks take turns arriving late at a 4-byte allreduce): a rank that had gone
// to sleep in the futex added 62-185 us per collective to the time the late
// rank needed, against 4-72 us when the waiter still polled, for lateness
// from 0.2 to 8 ms; in a training step the faster rank typically waits
// 0.3-1.5 ms. 20 ms covers that, and a rank waiting on a peer that does
// something long (an evaluation, a checkpoint) gives its core back after
// 20 ms all the same.
inline constexpr double kOwnCoreYieldSeconds = 20e-3;
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
