// Benchmark-only timing of the forward's parts per thread. With MHA_FLASH_TRACE defined (only
// benchmarks/probes/block_trace.py builds the forward so, through flash_ab.py's -D variants),
// each K/V packing and each query block records its wall-clock interval and its thread's CPU
// time, and each worker appends its records to /tmp/mha_flash_trace_<process id>.txt at the end
// of a call (the probe reads and removes it), one line per record:
//   thread  query_head  first_row  wall_start  wall_end  cpu_seconds
// (first_row -1: the packing of the K/V head, query_head = b * h_kv + K/V head then). The
// package's builds never define it: TraceSpan is empty and trace_flush does nothing.
#pragma once

#include <cstdint>

#if defined(MHA_FLASH_TRACE)
#include <cstdio>
#include <ctime>
#include <mutex>
#include <string>
#include <vector>

#include <unistd.h>
#endif

namespace mha_flash {
namespace {

#if defined(MHA_FLASH_TRACE)
struct TraceRecord {
  int64_t head, row;
  double w0, w1, cpu;
};

inline std::vector<TraceRecord>& trace_records() {
  thread_local std::vector<TraceRecord> records;
  return records;
}

inline double trace_clock(clockid_t id) {
  timespec t;
  clock_gettime(id, &t);
  return double(t.tv_sec) + 1e-9 * double(t.tv_nsec);
}

struct TraceSpan {  // records its scope's wall interval and the thread's CPU time in it
  int64_t head, row;
  double w0 = trace_clock(CLOCK_MONOTONIC), c0 = trace_clock(CLOCK_THREAD_CPUTIME_ID);
  TraceSpan(int64_t h, int64_t r) : head(h), row(r) {}
  ~TraceSpan() {
    const double c1 = trace_clock(CLOCK_THREAD_CPUTIME_ID);
    trace_records().push_back({head, row, w0, trace_clock(CLOCK_MONOTONIC), c1 - c0});
  }
};

inline void trace_flush(int thread) {
  std::vector<TraceRecord>& records = trace_records();
  static const std::string path = "/tmp/mha_flash_trace_" + std::to_string(getpid()) + ".txt";
  static std::mutex mu;
  std::lock_guard<std::mutex> lock(mu);
  if (FILE* f = std::fopen(path.c_str(), "a")) {
    for (const TraceRecord& r : records)
      std::fprintf(f, "%d %lld %lld %.9f %.9f %.9f\n", thread, (long long)r.head,
                   (long long)r.row, r.w0, r.w1, r.cpu);
    std::fclose(f);
  }
  records.clear();
}
#else
struct TraceSpan {
  TraceSpan(int64_t, int64_t) {}
};
inline void trace_flush(int) {}
#endif

}  // namespace
}  // namespace mha_flash
