// Host cost of the CUDA IPC engine over the fake device; see fake_bench.h.
#include "cuda/fake_bench.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <thread>

#include "cuda/fake_device.h"

namespace dualpipe::cuda {

namespace {

using Clock = std::chrono::steady_clock;
constexpr int kBuffers = 4;  // distinct buffers per side, reused round-robin as a burst does
constexpr double kWaitS = 30.0;

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

struct Burst {
  double post_s = 0;
  double total_s = 0;
  bool zero_copy = false;
};

Burst run_burst(Engine& tx, Engine& rx, std::uint64_t size, int messages, const std::vector<char*>& src,
                const std::vector<char*>& dst, std::int64_t tag0) {
  std::vector<std::shared_ptr<Op>> ops;
  ops.reserve(2 * static_cast<std::size_t>(messages));
  const auto t0 = Clock::now();
  for (int i = 0; i < messages; ++i) {
    ops.push_back(rx.post(OpKind::kRecv, 0, tag0 + i, dst[i % kBuffers], size, "Byte", nullptr, nullptr));
  }
  for (int i = 0; i < messages; ++i) {
    char* p = src[i % kBuffers];
    ops.push_back(tx.post(OpKind::kSend, 1, tag0 + i, p, size, "Byte", nullptr, nullptr, p, size));
  }
  const auto t1 = Clock::now();
  for (auto& op : ops) {
    if (!op->wait(kWaitS)) throw std::runtime_error("fake_host_cost: no completion within 30 s: " + op->describe());
  }
  Burst b;
  b.post_s = std::chrono::duration<double>(t1 - t0).count();
  b.total_s = std::chrono::duration<double>(Clock::now() - t0).count();
  b.zero_copy = ops.back()->zero_copy();
  return b;
}

}  // namespace

std::vector<FakeBenchRow> fake_host_cost(const std::vector<std::uint64_t>& sizes, int messages, int bursts,
                                         const EngineOptions& options) {
  if (messages < 1 || bursts < 1) throw std::invalid_argument("fake_host_cost needs messages >= 1 and bursts >= 1");
  auto dev = std::make_shared<testing::FakeDevice>();
  EngineOptions o = options;
  o.max_inflight = std::max(o.max_inflight, 1);
  Engine tx(dev, 0, 0, o);
  Engine rx(dev, 1, 0, o);
  tx.attach_outgoing(1, rx.create_incoming(0));
  rx.finish_incoming(0);
  std::vector<FakeBenchRow> rows;
  std::int64_t tag = 0;
  for (std::uint64_t size : sizes) {
    if (size == 0) throw std::invalid_argument("fake_host_cost: sizes must be positive");
    std::vector<char*> src(kBuffers), dst(kBuffers);
    for (int j = 0; j < kBuffers; ++j) {
      void* p = nullptr;
      void* q = nullptr;
      dev->malloc(&p, size);
      dev->malloc(&q, size);
      std::memset(p, j + 1, size);
      src[j] = static_cast<char*>(p);
      dst[j] = static_cast<char*>(q);
    }
    FakeBenchRow row;
    row.size_bytes = size;
    row.messages = messages;
    row.bursts = bursts;
    // one burst with bytes moved, checked
    dev->move_bytes = true;
    run_burst(tx, rx, size, std::min(messages, kBuffers), src, dst, tag);
    tag += messages;
    row.verified = true;
    for (int j = 0; j < kBuffers && j < messages; ++j) {
      for (std::uint64_t b = 0; b < size; ++b) {
        if (dst[j][b] != static_cast<char>(j + 1)) {
          row.verified = false;
          break;
        }
      }
    }
    if (!row.verified) throw std::runtime_error("fake_host_cost: a message arrived different from what was sent");
    dev->move_bytes = false;
    run_burst(tx, rx, size, messages, src, dst, tag);  // warm-up
    tag += messages;
    std::vector<double> post, total;
    for (int k = 0; k < bursts; ++k) {
      const Burst b = run_burst(tx, rx, size, messages, src, dst, tag);
      tag += messages;
      post.push_back(b.post_s);
      total.push_back(b.total_s);
      row.zero_copy = b.zero_copy;
    }
    row.host_us_per_msg = median(total) * 1e6 / messages;
    row.post_us_per_msg = median(post) * 1e6 / messages;
    row.complete_us_per_msg = row.host_us_per_msg - row.post_us_per_msg;
    rows.push_back(row);
  }
  // Together, as ranks close: each waits for the other to let go of what it maps.
  std::thread closer([&] { rx.close(5.0); });
  tx.close(5.0);
  closer.join();
  return rows;
}

}  // namespace dualpipe::cuda
