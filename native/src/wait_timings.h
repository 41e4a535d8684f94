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
// The relative costs that shape these choices: a pause-and-load poll is far
// cheaper than an MPI_Test from mpi4py, an idle sched_yield far cheaper than
// Python's time.sleep(0), and a liveness check (kill(pid, 0) and
// /proc/<pid>/stat) cheap enough to run ten times a second per peer. The
// benchmarks (keras_dist.bench latency) measure the result on each machine;
// the docs' performance page holds today's numbers.
#pragma once

namespace kd {

// Peers that enter a collective together arrive within a few microseconds
// when each has a core of its own. When two ranks share one core (more
// runnable processes than cores), the awaited peer cannot run until this rank
// gives the core up, and every poll before the first yield is lost: a long
// spin makes each small collective take the whole spin. A short spin covers
// ordinary skew and then yields.
inline constexpr double kSpinSeconds = 2e-6;
// Python's waits yield with time.sleep(0), which costs far more than the
// engine's sched_yield: they spin longer before giving the core up, about as
// long as a small MPI collective's usual skew.
inline constexpr double kPythonSpinSeconds = 50e-6;
// Ranks may outnumber cores (tests run 4 ranks on 2 cores): yielding lets an
// awaited peer that shares this core run. Short, because phase 3 wakes on the
// peer's publish anyway.
inline constexpr double kYieldSeconds = 100e-6;
// ...unless every local rank has a CPU of its own (no more local ranks than
// CPUs this process may run on: its affinity mask, and a container's cgroup
// CPU quota if it has one): then nothing else needs this rank's core, and a
// blocked waiter costs the job its wake-up (a rank asleep in the futex wakes
// later than one still polling). Long enough to cover how long the faster
// rank of a training step usually waits for the slower; a rank waiting on a
// peer that does something long (an evaluation, a checkpoint) still gives
// its core back.
inline constexpr double kOwnCoreYieldSeconds = 20e-3;
// Longest futex sleep per round: a publish wakes sleepers at once, so this
// only bounds how late an abort by another rank (which does not wake anyone)
// is noticed, which stays small next to the liveness period.
inline constexpr double kFutexWaitSeconds = 5e-3;
// Python's sleep between polls of an MPI request once yielding is over: adds
// little to a wait that has already lasted the spin and the yields, and
// keeps a waiting rank at a few percent of a core.
inline constexpr double kPollSleepSeconds = 2e-4;
// A dead peer is named within a tenth of a second, and the checks cost a
// negligible share of a core per peer.
inline constexpr double kLivenessSeconds = 0.1;

}  // namespace kd
