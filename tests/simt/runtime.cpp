// The host SIMT runtime of tests/simt: runs a kernel's blocks one after another, each block's
// threads as fibers on one host thread. A fiber runs until it waits at a rendezvous
// (__syncthreads, a warp collective); the scheduler resumes fibers round-robin and reports a
// deadlock when a full round makes no progress. Undefined behaviour the GPU would hide or
// punish is an error here: a barrier after some threads exited, a warp collective whose mask
// names an exited lane or differs between lanes, a memory fault (allocations end at a guard
// page). Shared memory is poisoned with 0xFF bytes before every block.
#include <dlfcn.h>
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstdio>
#include <deque>
#include <numeric>
#include <string>
#include <vector>

#include "simt_cuda.h"

extern "C" {
extern char __start_simt_shared[] __attribute__((weak));
extern char __stop_simt_shared[] __attribute__((weak));

// Saves the callee-saved registers on the current stack, stores the stack pointer in *save and
// resumes the stack `load` (a fiber's or the scheduler's): a context switch without the signal-mask
// system call of swapcontext. x86-64 System V.
void simt_switch(void** save, void* load);
}

#if !defined(__x86_64__)
#error "tests/simt/runtime.cpp: the fiber switch is written for x86-64"
#endif
asm(R"(
.text
.globl simt_switch
.type simt_switch,@function
simt_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
.size simt_switch, .-simt_switch
)");

namespace simt {

namespace {

constexpr std::size_t kStackBytes = 256 << 10;
constexpr std::size_t kDynamicSmemBytes = 256 << 10;

struct PendingCopy {
  void* dst;
  unsigned char bytes[16];
};

struct Warp {
  unsigned live = 0;          // lanes that exist and have not exited
  unsigned arrived = 0;       // lanes waiting at the open rendezvous
  unsigned mask = 0;          // the open rendezvous' mask
  unsigned long generation = 0;
  alignas(16) unsigned char slots[2][32][kExchangeBytes];
};

struct BlockState {
  unsigned threads = 0;
  unsigned live = 0;
  unsigned arrived = 0;
  unsigned long generation = 0;
};

}  // namespace

struct Fiber {
  void* sp = nullptr;  // saved stack pointer while switched out
  uint3 tid;
  unsigned warp = 0;
  unsigned lane = 0;
  bool done = false;
  const char* waiting = nullptr;
  const unsigned long* wait_on = nullptr;  // resumable once *wait_on != wait_value
  unsigned long wait_value = 0;
  std::vector<PendingCopy> uncommitted;
  std::deque<std::vector<PendingCopy>> groups;
  bool mma_fenced = false;  // a wgmma.fence since the thread's last wait
  std::vector<AsyncMma> mma_uncommitted;
  std::deque<std::vector<AsyncMma>> mma_groups;
  void* stack = nullptr;
};

Fiber* current = nullptr;
uint3 block_idx;
dim3 block_dim;
dim3 grid_dim;

namespace {

void* scheduler_sp = nullptr;
std::vector<Fiber> fibers;
std::vector<Warp> warps;
BlockState block;
unsigned long progress = 0;
std::string error;
alignas(1024) unsigned char dynamic_buffer[kDynamicSmemBytes];
void (*entry)(const void*) = nullptr;
const void* entry_params = nullptr;
volatile sig_atomic_t in_kernel = 0;
struct sigaction previous_segv;
struct sigaction previous_bus;
struct sigaction previous_ill;  // the host build's alignment checks trap with ud2

void* stack_for(Fiber& f) {
  if (!f.stack) {
    const long page = sysconf(_SC_PAGESIZE);
    void* base = mmap(nullptr, kStackBytes + page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (base == MAP_FAILED) return nullptr;
    mprotect(base, page, PROT_NONE);  // overflow faults instead of corrupting a neighbour
    f.stack = static_cast<char*>(base) + page;
  }
  return f.stack;
}

std::string where(const Fiber& f) {
  char text[160];
  std::snprintf(text, sizeof text, "block (%u,%u,%u) thread (%u,%u,%u)", block_idx.x, block_idx.y, block_idx.z,
                f.tid.x, f.tid.y, f.tid.z);
  return text;
}

void to_scheduler() { simt_switch(&current->sp, scheduler_sp); }

// Parks the current fiber until `*counter` moves past `value` (the scheduler checks before resuming).
void wait_for(const unsigned long* counter, unsigned long value, const char* what) {
  Fiber& f = *current;
  f.waiting = what;
  f.wait_on = counter;
  f.wait_value = value;
  while (*counter == value) to_scheduler();
  f.wait_on = nullptr;
  f.waiting = nullptr;
}

void land(std::vector<PendingCopy>& copies) {
  for (const PendingCopy& c : copies) std::memcpy(c.dst, c.bytes, 16);
  copies.clear();
}

void finish_current() {
  Fiber& f = *current;
  while (!f.groups.empty()) {
    land(f.groups.front());
    f.groups.pop_front();
  }
  land(f.uncommitted);
  if (!f.mma_uncommitted.empty() || !f.mma_groups.empty()) fail("a thread exited with a wgmma it never waited for");
  f.done = true;
  --block.live;
  warps[f.warp].live &= ~(1u << f.lane);
  ++progress;
  if (block.arrived) fail("a thread exited while others wait at __syncthreads");
  Warp& w = warps[f.warp];
  if (w.arrived && (w.mask >> f.lane) & 1u) fail("a lane exited while its warp waits for it at a warp collective");
}

[[noreturn]] void fiber_main() {
  entry(entry_params);
  finish_current();
  to_scheduler();  // never resumed: the fiber is done
  __builtin_unreachable();
}

void on_fault(int sig, siginfo_t* info, void* context) {
  if (!in_kernel) {
    const struct sigaction& prev = sig == SIGSEGV ? previous_segv : sig == SIGILL ? previous_ill : previous_bus;
    sigaction(sig, &prev, nullptr);
    return;  // the fault repeats under the previous handler
  }
  (void)context;
  const char* what = sig == SIGSEGV ? "illegal memory access"
                     : sig == SIGILL ? "misaligned access (a load or store at an address its type's alignment forbids)"
                                     : "bus error";
  char text[240];
  std::snprintf(text, sizeof text, "%s at %p (%s)", what, info->si_addr, current ? where(*current).c_str() : "?");
  if (error.empty()) error = text;
  void* abandoned;
  simt_switch(&abandoned, scheduler_sp);
}

void install_fault_handler() {
  static bool installed = false;
  if (installed) return;
  installed = true;
  static std::vector<char> alt(1 << 16);
  stack_t ss{};
  ss.ss_sp = alt.data();
  ss.ss_size = alt.size();
  sigaltstack(&ss, nullptr);
  struct sigaction action {};
  action.sa_sigaction = on_fault;
  action.sa_flags = SA_SIGINFO | SA_ONSTACK | SA_NODEFER;
  sigemptyset(&action.sa_mask);
  sigaction(SIGSEGV, &action, &previous_segv);
  sigaction(SIGBUS, &action, &previous_bus);
  sigaction(SIGILL, &action, &previous_ill);
}

// Static __shared__ arrays of function templates, which GCC places in .bss whatever their section
// attribute says (simt_set_template_shared): poisoned at every launch rather than every block.
std::vector<std::pair<char*, unsigned long>> template_shared;
unsigned long dynamic_bytes = 0;

void reset_block(unsigned threads) {
  block = BlockState{threads, threads, 0, 0};
  const unsigned warp_count = (threads + 31) / 32;
  warps.assign(warp_count, Warp{});
  for (unsigned w = 0; w < warp_count; ++w) {
    const unsigned lanes = std::min(32u, threads - w * 32);
    warps[w].live = lanes == 32 ? 0xffffffffu : ((1u << lanes) - 1);
  }
  if (__start_simt_shared != nullptr) std::memset(__start_simt_shared, 0xff, __stop_simt_shared - __start_simt_shared);
  std::memset(dynamic_buffer, 0xff, dynamic_bytes);
}

bool start_fibers(unsigned threads) {
  if (fibers.size() < threads) fibers.resize(threads);
  for (unsigned i = 0; i < threads; ++i) {
    Fiber& f = fibers[i];
    f.tid = {i % block_dim.x, (i / block_dim.x) % block_dim.y, i / (block_dim.x * block_dim.y)};
    f.warp = i / 32;
    f.lane = i % 32;
    f.done = false;
    f.waiting = nullptr;
    f.wait_on = nullptr;
    f.uncommitted.clear();
    f.groups.clear();
    f.mma_fenced = false;
    f.mma_uncommitted.clear();
    f.mma_groups.clear();
    char* stack = static_cast<char*>(stack_for(f));
    if (!stack) return false;
    // The frame simt_switch pops: six callee-saved registers, then fiber_main as the return
    // address, placed so fiber_main starts with the stack alignment of a call.
    void** frame = reinterpret_cast<void**>(stack + kStackBytes - 16);
    frame[1] = nullptr;
    frame[0] = reinterpret_cast<void*>(&fiber_main);
    for (int r = 1; r <= 6; ++r) frame[-r] = nullptr;
    f.sp = frame - 6;
  }
  return true;
}

std::string deadlock_report(unsigned threads) {
  std::string text = "deadlock: no thread can proceed;";
  unsigned shown = 0;
  for (unsigned i = 0; i < threads && shown < 4; ++i) {
    if (fibers[i].done) continue;
    text += " " + where(fibers[i]) + " waits at " + (fibers[i].waiting ? fibers[i].waiting : "?") + ";";
    ++shown;
  }
  return text;
}

// Runs one block to completion; false (with `error` set) on a failure. `reverse` resumes the
// fibers from the last thread down, so of two threads racing on an unsynchronised location each
// order shows up in some block.
bool run_block(unsigned threads, bool reverse) {
  reset_block(threads);
  if (!start_fibers(threads)) {
    error = "could not map fiber stacks";
    return false;
  }
  for (;;) {
    const unsigned long before = progress;
    bool any = false;
    for (unsigned n = 0; n < threads; ++n) {
      Fiber& f = fibers[reverse ? threads - 1 - n : n];
      if (f.done) continue;
      any = true;
      if (f.wait_on != nullptr && *f.wait_on == f.wait_value) continue;
      current = &f;
      simt_switch(&scheduler_sp, f.sp);
      if (!error.empty()) return false;
    }
    if (!any) return true;
    if (progress == before) {
      error = deadlock_report(threads);
      return false;
    }
  }
}

}  // namespace

const uint3& thread_idx() { return current->tid; }
unsigned lane_id() { return current->lane; }
void* dynamic_smem() { return dynamic_buffer; }

void fail(const char* what) {
  if (error.empty()) error = std::string(what) + " (" + where(*current) + ")";
  to_scheduler();
  __builtin_unreachable();
}

void syncthreads() {
  if (block.live != block.threads) fail("__syncthreads after some threads of the block exited");
  const unsigned long generation = block.generation;
  ++progress;
  if (++block.arrived == block.threads) {
    block.arrived = 0;
    ++block.generation;
  } else {
    wait_for(&block.generation, generation, "__syncthreads");
  }
}

const unsigned char* warp_exchange(unsigned mask, const void* mine, std::size_t bytes) {
  Fiber& f = *current;
  Warp& w = warps[f.warp];
  const unsigned bit = 1u << f.lane;
  if (!(mask & bit)) fail("a warp collective called by a lane outside its mask");
  if (mask & ~w.live) fail("a warp collective whose mask names a lane that exited or does not exist");
  if (w.arrived == 0) {
    w.mask = mask;
  } else if (w.mask != mask) {
    fail("lanes of one warp wait at warp collectives with different masks");
  }
  const unsigned long generation = w.generation;
  unsigned char* slots = &w.slots[generation & 1][0][0];
  std::memcpy(slots + f.lane * kExchangeBytes, mine, bytes);
  ++progress;
  w.arrived |= bit;
  if (w.arrived == mask) {
    w.arrived = 0;
    ++w.generation;
  } else {
    wait_for(&w.generation, generation, "a warp collective");
  }
  return slots;
}

void syncwarp(unsigned mask) { warp_exchange(mask, nullptr, 0); }

void async_copy(void* dst, const void* src, int bytes) {
  PendingCopy copy{dst, {}};
  if (bytes) std::memcpy(copy.bytes, src, static_cast<std::size_t>(bytes));
  current->uncommitted.push_back(copy);
}

void async_commit() {
  current->groups.push_back(std::move(current->uncommitted));
  current->uncommitted.clear();
}

void async_wait(int pending) {
  while (static_cast<int>(current->groups.size()) > pending) {
    land(current->groups.front());
    current->groups.pop_front();
  }
}

// The wgmma instructions are .sync.aligned: the warp meets at each, which also lets the other
// warps run between a thread's issue and its wait.
void mma_fence() {
  syncwarp(0xffffffffu);
  current->mma_fenced = true;
}

void mma_issue(AsyncMma op) {
  if (!current->mma_fenced) fail("a wgmma issued without a wgmma.fence since the thread's last wait");
  syncwarp(0xffffffffu);
  current->mma_uncommitted.push_back(std::move(op));
}

void mma_commit() {
  syncwarp(0xffffffffu);
  current->mma_groups.push_back(std::move(current->mma_uncommitted));
  current->mma_uncommitted.clear();
}

void mma_wait(int pending) {
  syncwarp(0xffffffffu);
  if (!current->mma_uncommitted.empty()) fail("wgmma.wait_group with a wgmma issued but not committed");
  while (static_cast<int>(current->mma_groups.size()) > pending) {
    for (AsyncMma& op : current->mma_groups.front()) op();
    current->mma_groups.pop_front();
  }
  current->mma_fenced = false;
}

}  // namespace simt

extern "C" {

// Runs kernel `fn` (a generated entry taking the params bytes) over the grid; 0 on success,
// else -1 with one line in `message`.
int simt_launch(void (*fn)(const void*), const void* params, const unsigned grid[3], const unsigned block[3],
                unsigned long smem, char* message, unsigned long message_size) {
  using namespace simt;
  install_fault_handler();
  error.clear();
  if (smem > kDynamicSmemBytes) {
    std::snprintf(message, message_size, "%lu B of dynamic shared memory; the emulator holds %zu", smem,
                  kDynamicSmemBytes);
    return -1;
  }
  entry = fn;
  entry_params = params;
  dynamic_bytes = smem;
  for (const auto& [start, size] : template_shared) std::memset(start, 0xff, size);
  grid_dim = {grid[0], grid[1], grid[2]};
  block_dim = {block[0], block[1], block[2]};
  const unsigned threads = block[0] * block[1] * block[2];
  in_kernel = 1;
  // Blocks run one at a time in a scrambled order (i -> i * stride mod count, stride coprime with
  // count), so a kernel that relies on block order fails here as it may on a GPU.
  const unsigned long count = static_cast<unsigned long>(grid[0]) * grid[1] * grid[2];
  unsigned long stride = 2654435761ul % count;
  while (count > 1 && std::gcd(stride, count) != 1) ++stride;
  bool ok = true;
  for (unsigned long i = 0; ok && i < count; ++i) {
    const unsigned long b = count > 1 ? (i * stride) % count : 0;
    block_idx = {static_cast<unsigned>(b % grid[0]), static_cast<unsigned>((b / grid[0]) % grid[1]),
                 static_cast<unsigned>(b / (static_cast<unsigned long>(grid[0]) * grid[1]))};
    ok = run_block(threads, i % 2 == 1);
  }
  in_kernel = 0;
  current = nullptr;
  if (ok) return 0;
  std::snprintf(message, message_size, "%s", error.c_str());
  return -1;
}

// The static __shared__ arrays that live outside the simt_shared section: `count` (offset from the
// library's load address, size) pairs read from its symbol table.
void simt_set_template_shared(const unsigned long* offsets, const unsigned long* sizes, unsigned long count) {
  Dl_info info;
  dladdr(reinterpret_cast<void*>(&simt_launch), &info);
  simt::template_shared.clear();
  for (unsigned long i = 0; i < count; ++i)
    simt::template_shared.emplace_back(static_cast<char*>(info.dli_fbase) + offsets[i], sizes[i]);
}

// Device memory: `size` bytes rounded up to `align` (a power of two, at most a page), starting
// `align`-aligned and ending at a guard page, so a read or write past the rounded end faults; the
// bytes start as 0xFF (cuMemAlloc promises nothing).
void* simt_alloc(unsigned long size, unsigned long align) {
  const unsigned long page = static_cast<unsigned long>(sysconf(_SC_PAGESIZE));
  const unsigned long body = (size + align - 1) / align * align;
  const unsigned long mapped = (body + page - 1) / page * page + page;
  char* base = static_cast<char*>(mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
  if (base == MAP_FAILED) return nullptr;
  char* guard = base + mapped - page;
  mprotect(guard, page, PROT_NONE);
  char* start = guard - body;
  std::memset(start, 0xff, body);
  return start;
}

void simt_free(void* ptr, unsigned long size, unsigned long align) {
  const unsigned long page = static_cast<unsigned long>(sysconf(_SC_PAGESIZE));
  const unsigned long body = (size + align - 1) / align * align;
  const unsigned long mapped = (body + page - 1) / page * page + page;
  char* guard = static_cast<char*>(ptr) + body;
  munmap(guard + page - mapped, mapped);
}

}  // extern "C"
