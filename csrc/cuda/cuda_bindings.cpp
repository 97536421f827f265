// pybind11 surface of the CUDA comm engine: dualpipe_kernels._C.cuda.
//
// The only file of csrc/cuda/ that knows torch: it turns tensors into raw
// pointers + byte counts, picks the caller's current CUDA stream, tells the
// caching allocator that the comm streams use the buffer, and releases the
// GIL around everything that can block.
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>

#include "cuda/api.h"
#include "cuda/fake_bench.h"
#include "cuda/ipc_engine.h"

namespace py = pybind11;

namespace dualpipe::cuda {
namespace {

int visible_device_count();

Staging parse_staging(const std::string& s) {
  if (s == "auto") return Staging::kAuto;
  if (s == "ipc") return Staging::kIpc;
  if (s == "host") return Staging::kHost;
  throw std::invalid_argument("staging must be 'auto', 'ipc' or 'host', got '" + s + "'");
}

bool interpreter_finalizing() {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsFinalizing() != 0;
#else
  return _Py_IsFinalizing() != 0;
#endif
}

// Python handle of one transfer. Holds the tensor so that Python code can
// read it back (the engine keeps its own reference until the copies are queued).
class PyOp {
 public:
  PyOp(std::shared_ptr<Op> op, at::Tensor tensor) : op_(std::move(op)), tensor_(std::move(tensor)) {}
  bool wait(double timeout_s) { return op_->wait(timeout_s); }
  bool query() { return op_->query(); }
  bool wait_stream(std::intptr_t stream, double timeout_s) {
    return op_->wait_stream(reinterpret_cast<Stream>(stream), timeout_s);
  }
  bool zero_copy() const { return op_->zero_copy(); }
  bool failed() const { return op_->failed(); }
  std::string error() const { return op_->error(); }
  std::string describe() const { return op_->describe(); }
  const at::Tensor& tensor() const { return tensor_; }

 private:
  std::shared_ptr<Op> op_;
  at::Tensor tensor_;
};

// Owns the engine; closing on destruction without the GIL, because close()
// joins the worker thread, which may need the GIL to drop a tensor.
class PyEngine {
 public:
  PyEngine(int rank, int device, int num_slots, std::int64_t slot_bytes, const std::string& staging,
           std::int64_t direct_min_bytes, int max_peer_mappings, int max_inflight) {
    if (slot_bytes <= 0) throw std::invalid_argument("slot_bytes must be positive, got " + std::to_string(slot_bytes));
    if (direct_min_bytes < 0) {
      throw std::invalid_argument("direct_min_bytes must be >= 0 (0: never zero-copy), got " +
                                  std::to_string(direct_min_bytes));
    }
    EngineOptions options;
    options.direct_min_bytes = static_cast<std::uint64_t>(direct_min_bytes);
    options.num_slots = num_slots;
    options.slot_bytes = static_cast<std::uint64_t>(slot_bytes);
    options.staging = parse_staging(staging);
    if (max_peer_mappings < 1 || max_peer_mappings > kMaxExports) {
      throw std::invalid_argument("max_peer_mappings must be in [1, " + std::to_string(kMaxExports) + "], got " +
                                  std::to_string(max_peer_mappings));
    }
    options.max_peer_mappings = static_cast<std::uint32_t>(max_peer_mappings);
    options.max_inflight = max_inflight;  // the engine checks the range
    // Three high-priority streams of torch's pool: never destroyed, so a buffer
    // recorded on them (post()) can be freed at any time, even after close.
    if (device >= 0 && device < visible_device_count()) {
      const auto index = static_cast<c10::DeviceIndex>(device);
      const auto send = c10::cuda::getStreamFromPool(/*isHighPriority=*/true, index);
      auto recv = c10::cuda::getStreamFromPool(/*isHighPriority=*/true, index);
      while (recv.stream() == send.stream()) recv = c10::cuda::getStreamFromPool(true, index);
      auto done = c10::cuda::getStreamFromPool(/*isHighPriority=*/true, index);
      while (done.stream() == send.stream() || done.stream() == recv.stream()) {
        done = c10::cuda::getStreamFromPool(true, index);
      }
      options.send_stream = send.stream();
      options.recv_stream = recv.stream();
      options.done_stream = done.stream();
    }
    engine_ = std::make_unique<Engine>(cuda_runtime_api(), rank, device, options);
  }
  ~PyEngine() {
    if (PyGILState_Check()) {
      py::gil_scoped_release nogil;
      engine_.reset();
    } else {
      engine_.reset();
    }
  }
  PyEngine(const PyEngine&) = delete;
  PyEngine& operator=(const PyEngine&) = delete;

  Engine& engine() { return *engine_; }

  // Start and size of the caching-allocator segment holding a large send
  // buffer (what cudaIpcGetMemHandle needs for a zero-copy send), or null:
  // small message, zero-copy off, or memory the caching allocator does not
  // own. Looked up by the storage's pointer (a block start, as the allocator
  // records blocks), so a view at any offset goes zero-copy too; the engine
  // sends ptr - base. The tensor the engine holds keeps its block, and so the
  // segment, allocated: the allocator frees only segments with no block in use.
  std::pair<void*, std::uint64_t> allocation_base(const at::Tensor& t, std::uint64_t bytes) {
    const std::uint64_t threshold = engine_->direct_min_bytes();
    if (threshold == 0 || bytes < threshold) return {nullptr, 0};
    try {
      std::size_t size = 0;
      void* base = c10::cuda::CUDACachingAllocator::getBaseAllocation(t.storage().data_ptr().get(), &size);
      const auto* p = static_cast<const char*>(t.data_ptr());
      const auto* b = static_cast<const char*>(base);
      if (base == nullptr || p < b || p + bytes > b + size) return {nullptr, 0};
      return {base, static_cast<std::uint64_t>(size)};
    } catch (const std::exception&) {
      return {nullptr, 0};
    }
  }

  PyOp post(OpKind kind, const at::Tensor& t, int peer, std::int64_t tag) {
    const char* verb = kind == OpKind::kSend ? "send" : "receive";
    if (!t.is_cuda()) {
      throw std::invalid_argument(std::string(verb) + " tensor must be a CUDA tensor, got one on " + t.device().str());
    }
    if (t.device().index() != engine_->device()) {
      throw std::invalid_argument(std::string(verb) + " tensor is on " + t.device().str() +
                                  " but the transport uses cuda:" + std::to_string(engine_->device()));
    }
    if (!t.is_contiguous()) throw std::invalid_argument(std::string(verb) + " tensor must be contiguous");
    c10::cuda::CUDAGuard guard(t.device());
    const Stream caller = c10::cuda::getCurrentCUDAStream(t.device().index()).stream();
    const std::uint64_t bytes = static_cast<std::uint64_t>(t.nbytes());
    if (bytes > 0) {
      // The caching allocator must not hand this block out again before the
      // comm stream's copies have run, even if the caller frees it early.
      c10::cuda::CUDACachingAllocator::recordStream(
          t.storage().data_ptr(),
          c10::cuda::getStreamFromExternal(static_cast<cudaStream_t>(engine_->stream_for(kind)), engine_->device()));
      // a zero-copy send completes on the done stream (after the peer's copy out of this buffer)
      if (kind == OpKind::kSend) {
        c10::cuda::CUDACachingAllocator::recordStream(
            t.storage().data_ptr(),
            c10::cuda::getStreamFromExternal(static_cast<cudaStream_t>(engine_->done_stream()), engine_->device()));
      }
    }
    // The worker drops this reference; during interpreter finalisation that
    // could touch a dying interpreter, so then the tensor is leaked instead.
    std::shared_ptr<void> keepalive(new at::Tensor(t), [](void* p) {
      if (interpreter_finalizing()) return;
      delete static_cast<at::Tensor*>(p);
    });
    const auto alloc = kind == OpKind::kSend ? allocation_base(t, bytes) : std::pair<void*, std::uint64_t>{};
    auto op = engine_->post(kind, peer, tag, bytes > 0 ? t.data_ptr() : nullptr, bytes,
                            std::string(c10::toString(t.scalar_type())), caller, std::move(keepalive), alloc.first,
                            alloc.second);
    return PyOp(std::move(op), t);
  }

 private:
  std::unique_ptr<Engine> engine_;
};

py::dict stats_dict(const EngineStats& s) {
  py::dict d;
  d["zero_copy_sends"] = s.zero_copy_sends;
  d["staged_sends"] = s.staged_sends;
  d["zero_copy_recvs"] = s.zero_copy_recvs;
  d["staged_recvs"] = s.staged_recvs;
  d["mem_handle_exports"] = s.mem_handle_exports;
  d["zero_copy_deferred"] = s.zero_copy_deferred;
  d["exports_released"] = s.exports_released;
  d["peer_mappings_opened"] = s.peer_mappings_opened;
  d["peer_mappings_closed"] = s.peer_mappings_closed;
  d["exports_leaked"] = s.exports_leaked;
  d["events_created"] = s.events_created;
  d["stream_waits"] = s.stream_waits;
  d["peers_died"] = s.peers_died;
  return d;
}

// Host cost per message over the fake device (no GPU needed): rows of dicts.
py::list fake_host_cost_py(const std::vector<std::uint64_t>& sizes, int messages, int bursts, int num_slots,
                           std::int64_t slot_bytes, std::int64_t direct_min_bytes, int max_inflight) {
  EngineOptions o;
  o.num_slots = num_slots;
  if (slot_bytes <= 0 || direct_min_bytes < 0) throw std::invalid_argument("slot_bytes > 0 and direct_min_bytes >= 0");
  o.slot_bytes = static_cast<std::uint64_t>(slot_bytes);
  o.direct_min_bytes = static_cast<std::uint64_t>(direct_min_bytes);
  o.max_inflight = max_inflight;
  o.staging = Staging::kIpc;
  std::vector<FakeBenchRow> rows;
  {
    py::gil_scoped_release nogil;
    rows = fake_host_cost(sizes, messages, bursts, o);
  }
  py::list out;
  for (const auto& r : rows) {
    py::dict d;
    d["size_bytes"] = r.size_bytes;
    d["messages"] = r.messages;
    d["bursts"] = r.bursts;
    d["host_us_per_msg"] = r.host_us_per_msg;
    d["post_us_per_msg"] = r.post_us_per_msg;
    d["complete_us_per_msg"] = r.complete_us_per_msg;
    d["zero_copy"] = r.zero_copy;
    d["verified"] = r.verified;
    out.append(d);
  }
  return out;
}

int visible_device_count() {
  int count = 0;
  // No driver or no device is "zero devices" here, not an error.
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return count;
}

int runtime_version() {
  int v = 0;
  const cudaError_t r = cudaRuntimeGetVersion(&v);
  if (r != cudaSuccess) throw std::runtime_error(std::string("cudaRuntimeGetVersion failed: ") + cudaGetErrorName(r));
  return v;
}

}  // namespace

void register_apis(py::module_& m) {
  py::module_ c = m.def_submodule("cuda", "CUDA IPC comm engine (present only in CUDA builds)");
  c.attr("compiled_with_cuda") = true;
  c.attr("cuda_version_compiled") = CUDART_VERSION;
  c.attr("max_slots") = kMaxSlots;
  c.def("runtime_version", &runtime_version, "CUDA runtime version (e.g. 13000)");
  c.def("device_count", &visible_device_count, "number of visible CUDA devices (0 when there is no driver or device)");
  c.attr("max_inflight") = kMaxInflight;
  c.def("fake_host_cost", &fake_host_cost_py, py::arg("sizes"), py::arg("messages"), py::arg("bursts"),
        py::arg("num_slots") = 4, py::arg("slot_bytes") = std::int64_t{4} << 20,
        py::arg("direct_min_bytes") = std::int64_t{1} << 20, py::arg("max_inflight") = 256,
        "host microseconds per message of the engine over the fake device (both ends in this process; no GPU): "
        "one dict per size {size_bytes, messages, bursts, host_us_per_msg, post_us_per_msg, complete_us_per_msg, "
        "zero_copy, verified}");

  py::class_<PyOp>(c, "IpcOp", "one posted transfer")
      .def("wait", &PyOp::wait, py::arg("timeout_s"), py::call_guard<py::gil_scoped_release>(),
           "block until done; False on timeout; RuntimeError when the transfer failed (negative: no limit)")
      .def("query", &PyOp::query, py::call_guard<py::gil_scoped_release>(), "True when done or failed")
      .def("wait_stream", &PyOp::wait_stream, py::arg("stream"), py::arg("timeout_s"),
           py::call_guard<py::gil_scoped_release>(),
           "make the CUDA stream (a cudaStream_t as int) wait for the transfer; blocks the host only until the "
           "copies are enqueued; False on timeout")
      .def("failed", &PyOp::failed)
      .def("error", &PyOp::error)
      .def("describe", &PyOp::describe)
      .def_property_readonly("zero_copy", &PyOp::zero_copy, "True if this send went straight from its buffer")
      .def_property_readonly("tensor", &PyOp::tensor);

  py::class_<PyEngine>(c, "IpcEngine", "per-process CUDA comm engine: channels, comm streams, worker thread")
      .def(py::init<int, int, int, std::int64_t, const std::string&, std::int64_t, int, int>(), py::arg("rank"),
           py::arg("device"), py::arg("num_slots") = 4, py::arg("slot_bytes") = std::int64_t{4} << 20,
           py::arg("staging") = "auto", py::arg("direct_min_bytes") = std::int64_t{1} << 20,
           py::arg("max_peer_mappings") = 32, py::arg("max_inflight") = 256)
      .def("stats", [](PyEngine& e) { return stats_dict(e.engine().stats()); },
           "counters: zero_copy_sends, staged_sends, zero_copy_recvs, staged_recvs, mem_handle_exports, "
           "zero_copy_deferred, exports_released, peer_mappings_opened, peer_mappings_closed, exports_leaked, "
           "events_created, stream_waits, peers_died")
      .def_property_readonly("signal_mechanism", [](PyEngine& e) { return e.engine().device_api().signal_mechanism(); },
                             "how the streams signal each other: 'stream memory ops' or 'spin kernels'")
      .def_property_readonly("rank", [](PyEngine& e) { return e.engine().rank(); })
      .def_property_readonly("device", [](PyEngine& e) { return e.engine().device(); })
      .def_property_readonly(
          "send_stream", [](PyEngine& e) { return reinterpret_cast<std::intptr_t>(e.engine().stream_for(OpKind::kSend)); })
      .def_property_readonly(
          "recv_stream", [](PyEngine& e) { return reinterpret_cast<std::intptr_t>(e.engine().stream_for(OpKind::kRecv)); })
      .def("fail_all", [](PyEngine& e, const std::string& message) { e.engine().fail_all(message); },
           py::arg("message"), py::call_guard<py::gil_scoped_release>(),
           "fail every unfinished and later transfer with `message` (blocked waits raise it)")
      .def("create_incoming", [](PyEngine& e, int src) { return e.engine().create_incoming(src); }, py::arg("src"),
           py::call_guard<py::gil_scoped_release>())
      .def("attach_outgoing", [](PyEngine& e, int dst, const std::string& name) { e.engine().attach_outgoing(dst, name); },
           py::arg("dst"), py::arg("shm_name"), py::call_guard<py::gil_scoped_release>())
      .def("finish_incoming", [](PyEngine& e, int src) { e.engine().finish_incoming(src); }, py::arg("src"),
           py::call_guard<py::gil_scoped_release>())
      .def("channel_staging", [](PyEngine& e, int peer, bool outgoing) { return e.engine().channel_staging(peer, outgoing); },
           py::arg("peer"), py::arg("outgoing"))
      .def("channel_status", [](PyEngine& e, int peer, bool outgoing) { return e.engine().channel_status(peer, outgoing); },
           py::arg("peer"), py::arg("outgoing"))
      .def("send", [](PyEngine& e, const at::Tensor& t, int peer, std::int64_t tag) { return e.post(OpKind::kSend, t, peer, tag); },
           py::arg("tensor"), py::arg("peer"), py::arg("tag"), py::call_guard<py::gil_scoped_release>())
      .def("recv", [](PyEngine& e, const at::Tensor& t, int peer, std::int64_t tag) { return e.post(OpKind::kRecv, t, peer, tag); },
           py::arg("tensor"), py::arg("peer"), py::arg("tag"), py::call_guard<py::gil_scoped_release>())
      .def("close", [](PyEngine& e, double timeout_s) { e.engine().close(timeout_s); }, py::arg("timeout_s") = 10.0,
           py::call_guard<py::gil_scoped_release>());
}

}  // namespace dualpipe::cuda
