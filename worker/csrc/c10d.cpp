// libtorch's c10d process groups for accrue (worker/src/comm/c10d): gloo on
// the CPU (ProcessGroupGloo, the engine torch.distributed runs on) and, in a
// CUDA build (ACCRUE_C10D_NCCL, set by build.rs under ACCRUE_CUDA=1), NCCL
// on CUDA (ProcessGroupNCCL, what DDP and FSDP run on GPUs), through a
// plain C interface. The rendezvous store is accrue's own: a c10d::Store
// whose every call goes to Rust callbacks (an authenticated key-value server
// hosted by world rank 0, worker/src/comm/c10d/store.rs), so no process
// without the generation's key can add itself to a group.
//
// Tensor handles are tch's (`at::Tensor*`); groups, works and stores are
// opaque pointers the Rust side owns and frees. Every function returns 0, or
// -1 with the exception's message (without its backtrace) in err.
#include <ATen/ATen.h>
#include "shim.h"
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/autograd/custom_function.h>
#ifdef ACCRUE_C10D_NCCL
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

#include <algorithm>
#include <atomic>
#include <chrono>
#include <functional>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

namespace {

using accrue_shim::guarded;
using accrue_shim::write_error;

at::Tensor& tensor(void* p) { return *static_cast<at::Tensor*>(p); }

// The Rust side of a store. Each callback returns 0 or -1 with a message in
// err; `get` and `add` answer through `out` (bytes) or `value`.
struct StoreCallbacks {
  void* ctx;
  // kind 0 set, 1 get (blocks until the key exists or the timeout),
  // 2 add, 3 check, 4 delete, 5 count. out/out_len: a buffer the Rust side
  // allocated with malloc (get), which this side frees.
  int (*call)(void* ctx, int kind, const char* key, size_t key_len, const uint8_t* value,
              size_t value_len, int64_t arg, int64_t timeout_ms, uint8_t** out, size_t* out_len,
              int64_t* number, char* err, size_t len);
};

class RustStore : public c10d::Store {
 public:
  explicit RustStore(StoreCallbacks cb) : cb_(cb) {}

  c10::intrusive_ptr<c10d::Store> clone() override {
    return c10::intrusive_ptr<c10d::Store>::reclaim_copy(this);
  }

  void set(const std::string& key, const std::vector<uint8_t>& value) override {
    call(0, key, value.data(), value.size(), 0);
  }

  std::vector<uint8_t> compareSet(const std::string& key, const std::vector<uint8_t>&,
                                  const std::vector<uint8_t>&) override {
    TORCH_CHECK(false, "accrue's store does not offer compareSet (key ", key, ")");
  }

  std::vector<uint8_t> get(const std::string& key) override {
    return call(1, key, nullptr, 0, 0).first;
  }

  int64_t add(const std::string& key, int64_t value) override {
    return call(2, key, nullptr, 0, value).second;
  }

  bool deleteKey(const std::string& key) override { return call(4, key, nullptr, 0, 0).second != 0; }

  bool check(const std::vector<std::string>& keys) override {
    for (const auto& k : keys) {
      if (call(3, k, nullptr, 0, 0).second == 0) {
        return false;
      }
    }
    return true;
  }

  int64_t getNumKeys() override { return call(5, "", nullptr, 0, 0).second; }

  void wait(const std::vector<std::string>& keys) override { wait(keys, timeout_); }

  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) override {
    for (const auto& k : keys) {
      callWithTimeout(1, k, nullptr, 0, 0, timeout.count());
    }
  }

 private:
  std::pair<std::vector<uint8_t>, int64_t> call(int kind, const std::string& key, const uint8_t* value,
                                                size_t value_len, int64_t arg) {
    return callWithTimeout(kind, key, value, value_len, arg, timeout_.count());
  }

  std::pair<std::vector<uint8_t>, int64_t> callWithTimeout(int kind, const std::string& key,
                                                           const uint8_t* value, size_t value_len,
                                                           int64_t arg, int64_t timeout_ms) {
    std::lock_guard<std::mutex> lock(mu_);
    uint8_t* out = nullptr;
    size_t out_len = 0;
    int64_t number = 0;
    char err[512] = {0};
    int rc = cb_.call(cb_.ctx, kind, key.data(), key.size(), value, value_len, arg, timeout_ms, &out,
                      &out_len, &number, err, sizeof(err));
    std::vector<uint8_t> bytes;
    if (out != nullptr) {
      bytes.assign(out, out + out_len);
      std::free(out);
    }
    if (rc != 0) {
      throw std::runtime_error(std::string("accrue c10d store: ") + err);
    }
    return {std::move(bytes), number};
  }

  StoreCallbacks cb_;
  std::mutex mu_;
};

struct Group {
  c10::intrusive_ptr<c10d::Backend> backend;
  // Every operation's timeout (the tensor-parallel operations below wait
  // this long at most).
  int64_t timeout_ms = 0;
};

struct Work {
  c10::intrusive_ptr<c10d::Work> work;
};

c10d::ReduceOp reduce_op(int op) {
  switch (op) {
    case 0:
      return c10d::ReduceOp::SUM;
    case 1:
      return c10d::ReduceOp::MAX;
    default:
      TORCH_CHECK(false, "unknown reduce op ", op, " (0 sum, 1 max)");
  }
}

int start(void* g, void** work, char* err, size_t len,
          const std::function<c10::intrusive_ptr<c10d::Work>(c10d::Backend&)>& f) {
  return guarded(
      [&] {
        auto* group = static_cast<Group*>(g);
        *work = new Work{f(*group->backend)};
      },
      err, len);
}

// Tensor parallelism (issue 42): Megatron-LM's mappings between a tensor
// group's ranks as autograd functions, so that one backward of the model
// runs their mirrors (megatron/core/tensor_parallel/mappings.py). The
// function keeps the group's address: the Rust side keeps the group alive
// while any graph made with it lives (a generation's graphs end with it).

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Payload bytes of this process's tensor-parallel reductions: the layers'
// (f, g and the shared slices' sums) and the rest (the cross-entropy's
// reductions, the logits' gathers, the norm), for the benchmarks.
std::atomic<int64_t> layer_bytes{0};
std::atomic<int64_t> other_bytes{0};

// A failed operation of the tensor group: the message starts with this
// marker, which the worker's error conversion reads as a lost peer (a new
// generation), not a fault of the job (worker/src/error.rs).
const char* const kTensorGroupFailed = "accrue tensor group: ";

// Runs `op` (which starts an operation) and waits for it, at most the
// group's timeout; any failure is rethrown with the marker.
void wait_for(Group* g, const std::function<c10::intrusive_ptr<c10d::Work>()>& op,
              const char* what) {
  try {
    auto w = op();
    bool done = g->timeout_ms > 0 ? w->wait(std::chrono::milliseconds(g->timeout_ms)) : w->wait();
    TORCH_CHECK(done, what, " did not complete within ", g->timeout_ms, " ms");
  } catch (const c10::Error& e) {
    throw std::runtime_error(std::string(kTensorGroupFailed) + what + ": " +
                             e.what_without_backtrace());
  } catch (const std::exception& e) {
    throw std::runtime_error(std::string(kTensorGroupFailed) + what + ": " + e.what());
  }
}

// Whether `t` must go through the host for the group: a CUDA tensor on a
// gloo group (ranks that share a GPU, where NCCL cannot run).
bool through_host(Group* g, const at::Tensor& t) {
  return t.is_cuda() && g->backend->getBackendName() == "gloo";
}

// Sums `t` (contiguous) over the group in place; bf16 and fp16 partials
// are summed in float32 and rounded once, as one matmul's accumulation
// would be.
void sum_now(Group* g, at::Tensor& t, const char* what) {
  if (t.scalar_type() == at::kBFloat16 || t.scalar_type() == at::kHalf) {
    at::Tensor wide = t.to(at::kFloat);
    sum_now(g, wide, what);
    t.copy_(wide);
    return;
  }
  if (through_host(g, t)) {
    at::Tensor host = t.cpu();
    sum_now(g, host, what);
    t.copy_(host);
    return;
  }
  layer_bytes += t.numel() * static_cast<int64_t>(t.element_size());
  std::vector<at::Tensor> ts{t};
  c10d::AllreduceOptions o;
  o.reduceOp = c10d::ReduceOp::SUM;
  wait_for(g, [&] { return g->backend->allreduce(ts, o); }, what);
}

Group* group_of(AutogradContext* ctx) {
  return reinterpret_cast<Group*>(ctx->saved_data["group"].toInt());
}

// f (copy to the tensor-parallel region): the identity forward; the
// gradient summed over the group backward (each rank's column shards gave
// part of the input's gradient).
struct TpCopy : public torch::autograd::Function<TpCopy> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, int64_t g) {
    ctx->saved_data["group"] = g;
    return x.view_as(x);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    at::Tensor gx = grads[0].contiguous().clone();
    sum_now(group_of(ctx), gx, "the input gradient's sum");
    return {gx, at::Tensor()};
  }
};

// g (reduce from the tensor-parallel region): the row shards' partial
// outputs summed over the group forward; the identity backward.
struct TpReduce : public torch::autograd::Function<TpReduce> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, int64_t g) {
    (void)ctx;
    at::Tensor y = x.contiguous().clone();
    sum_now(reinterpret_cast<Group*>(g), y, "the partial outputs' sum");
    return y;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    (void)ctx;
    return {grads[0], at::Tensor()};
  }
};

// A slice several ranks hold (rows start..start + n of a tensor `whole`
// rows long along `dim`: a key-value head serving T / kv ranks): the
// identity forward; backward, each rank's gradient placed at its rows of
// a zero tensor of the whole shape, summed over the group, and its rows
// taken back: the sum over the ranks that share the slice.
struct TpSharedSum : public torch::autograd::Function<TpSharedSum> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, int64_t g, int64_t dim,
                            int64_t start, int64_t whole) {
    ctx->saved_data["group"] = g;
    ctx->saved_data["dim"] = dim;
    ctx->saved_data["start"] = start;
    ctx->saved_data["whole"] = whole;
    return x.view_as(x);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    int64_t dim = ctx->saved_data["dim"].toInt();
    int64_t start = ctx->saved_data["start"].toInt();
    const at::Tensor& gx = grads[0];
    std::vector<int64_t> shape = gx.sizes().vec();
    int64_t n = shape[dim];
    shape[dim] = ctx->saved_data["whole"].toInt();
    at::Tensor all = at::zeros(shape, gx.options());
    all.narrow(dim, start, n).copy_(gx);
    sum_now(group_of(ctx), all, "the shared slice's gradient sum");
    return {all.narrow(dim, start, n).contiguous(), at::Tensor(), at::Tensor(), at::Tensor(),
            at::Tensor()};
  }
};

// Every rank's last-dimension shard (`sizes[r]` wide, rank order) joined:
// the vocabulary-parallel head's logits whole. Backward: this rank's
// columns of the gradient.
struct TpGatherLast : public torch::autograd::Function<TpGatherLast> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, int64_t g,
                            std::vector<int64_t> sizes, int64_t rank) {
    auto* group = reinterpret_cast<Group*>(g);
    int64_t widest = *std::max_element(sizes.begin(), sizes.end());
    at::Tensor xp = through_host(group, x) ? x.cpu() : x.contiguous();
    if (xp.size(-1) < widest) {
      xp = at::constant_pad_nd(xp, {0, widest - xp.size(-1)});
    }
    std::vector<std::vector<at::Tensor>> out(1);
    for (size_t r = 0; r < sizes.size(); ++r) {
      out[0].push_back(at::empty_like(xp));
    }
    std::vector<at::Tensor> in{xp};
    other_bytes += xp.numel() * static_cast<int64_t>(xp.element_size());
    wait_for(group, [&] { return group->backend->allgather(out, in); }, "gathering the shards");
    std::vector<at::Tensor> parts;
    int64_t start = 0;
    for (size_t r = 0; r < sizes.size(); ++r) {
      parts.push_back(out[0][r].narrow(-1, 0, sizes[r]));
      if (static_cast<int64_t>(r) < rank) {
        start += sizes[r];
      }
    }
    ctx->saved_data["start"] = start;
    ctx->saved_data["width"] = sizes[rank];
    return at::cat(parts, -1).to(x.device());
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    at::Tensor gx = grads[0].narrow(-1, ctx->saved_data["start"].toInt(),
                                     ctx->saved_data["width"].toInt());
    return {gx, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

extern "C" {

// Tensor parallelism: f, g and the gather (above) on group `g`; each makes
// a new tensor handle in `out`.
int accrue_tp_copy(void* g, void* x, void** out, char* err, size_t len) {
  return guarded(
      [&] { *out = new at::Tensor(TpCopy::apply(tensor(x), reinterpret_cast<int64_t>(g))); }, err,
      len);
}

int accrue_tp_reduce(void* g, void* x, void** out, char* err, size_t len) {
  return guarded(
      [&] { *out = new at::Tensor(TpReduce::apply(tensor(x), reinterpret_cast<int64_t>(g))); },
      err, len);
}

int accrue_tp_gather_last(void* g, void* x, const int64_t* sizes, int n, int rank, void** out,
                          char* err, size_t len) {
  return guarded(
      [&] {
        TORCH_CHECK(n > 0 && rank >= 0 && rank < n, "rank ", rank, " of ", n, " shards");
        std::vector<int64_t> s(sizes, sizes + n);
        *out = new at::Tensor(TpGatherLast::apply(tensor(x), reinterpret_cast<int64_t>(g), s,
                                                  static_cast<int64_t>(rank)));
      },
      err, len);
}

int accrue_tp_shared_sum(void* g, void* x, int64_t dim, int64_t start, int64_t whole, void** out,
                         char* err, size_t len) {
  return guarded(
      [&] {
        *out = new at::Tensor(
            TpSharedSum::apply(tensor(x), reinterpret_cast<int64_t>(g), dim, start, whole));
      },
      err, len);
}

// The payload bytes above: the layers' reductions, then the rest.
void accrue_tp_bytes(int64_t* layers, int64_t* other) {
  *layers = layer_bytes.load();
  *other = other_bytes.load();
}

// `t` (contiguous) reduced over the group in place, waiting (op: 0 sum, 1 max).
int accrue_tp_all_reduce(void* g, void* t, int op, char* err, size_t len) {
  return guarded(
      [&] {
        auto* group = static_cast<Group*>(g);
        at::Tensor& target = tensor(t);
        other_bytes += target.numel() * static_cast<int64_t>(target.element_size());
        at::Tensor work = through_host(group, target) ? target.cpu() : target;
        std::vector<at::Tensor> ts{work};
        c10d::AllreduceOptions o;
        o.reduceOp = reduce_op(op);
        wait_for(group, [&] { return group->backend->allreduce(ts, o); }, "a reduction");
        if (!work.is_same(target)) {
          target.copy_(work);
        }
      },
      err, len);
}

// A store whose calls go to `call` with `ctx`; freed with accrue_c10d_store_free.
void* accrue_c10d_store_new(void* ctx, void* call) {
  StoreCallbacks cb{ctx, reinterpret_cast<decltype(StoreCallbacks::call)>(call)};
  auto store = c10::make_intrusive<RustStore>(cb);
  return store.release();
}

void accrue_c10d_store_free(void* store) {
  if (store != nullptr) {
    c10::intrusive_ptr<RustStore>::reclaim(static_cast<RustStore*>(store));
  }
}

// A gloo group of `size` ranks over `store` (keys are the caller's to scope),
// its pairs on the interface of `hostname`. Returns once every rank joined,
// or fails after `timeout_ms`, the timeout of every operation too.
int accrue_c10d_gloo_new(void* store, const char* hostname, int rank, int size, int64_t timeout_ms,
                         void** group, char* err, size_t len) {
  return guarded(
      [&] {
        auto s = c10::intrusive_ptr<c10d::Store>::reclaim_copy(static_cast<RustStore*>(store));
        auto opts = c10d::ProcessGroupGloo::Options::create_default(std::chrono::milliseconds(timeout_ms));
        opts->devices.clear();
        opts->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname(hostname));
        opts->threads = 2;
        auto pg = c10::make_intrusive<c10d::ProcessGroupGloo>(s, rank, size, opts);
        *group = new Group{pg, timeout_ms};
      },
      err, len);
}

// 1 when this build can make NCCL groups (a CUDA build), 0 otherwise.
int accrue_c10d_has_nccl() {
#ifdef ACCRUE_C10D_NCCL
  return 1;
#else
  return 0;
#endif
}

// An NCCL group of `size` ranks over `store`, this rank on CUDA device
// `device`. The communicator is made now (eagerly, bound to the device), so
// a rank that cannot join fails here, not at the first operation. Every
// wait passes its timeout, so ProcessGroupNCCL blocks the calling thread
// until the operation completes or the timeout passes (then it aborts the
// communicator and throws), as TORCH_NCCL_BLOCKING_WAIT would.
int accrue_c10d_nccl_new(void* store, int rank, int size, int64_t timeout_ms, int device,
                         void** group, char* err, size_t len) {
  return guarded(
      [&] {
#ifdef ACCRUE_C10D_NCCL
        auto s = c10::intrusive_ptr<c10d::Store>::reclaim_copy(static_cast<RustStore*>(store));
        auto opts = c10d::ProcessGroupNCCL::Options::create();
        opts->timeout = std::chrono::milliseconds(timeout_ms);
        auto pg = c10::make_intrusive<c10d::ProcessGroupNCCL>(s, rank, size, opts);
        pg->eagerConnectSingleDevice(at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(device)));
        *group = new Group{pg, timeout_ms};
#else
        (void)store;
        (void)rank;
        (void)size;
        (void)timeout_ms;
        (void)device;
        (void)group;
        TORCH_CHECK(false, "this worker was built without CUDA: NCCL groups need a CUDA build (make gpu-worker)");
#endif
      },
      err, len);
}

void accrue_c10d_group_free(void* g) { delete static_cast<Group*>(g); }

// Aborts the group's communicator: pending and later operations fail.
int accrue_c10d_group_abort(void* g, char* err, size_t len) {
  return guarded([&] { static_cast<Group*>(g)->backend->abort(); }, err, len);
}

int accrue_c10d_all_reduce(void* g, void* t, int op, void** work, char* err, size_t len) {
  return start(g, work, err, len, [&](c10d::Backend& b) {
    std::vector<at::Tensor> ts{tensor(t)};
    c10d::AllreduceOptions o;
    o.reduceOp = reduce_op(op);
    return b.allreduce(ts, o);
  });
}

// `out` (this rank's 1/size of `in`) receives the reduction of every rank's
// matching slice of `in`.
int accrue_c10d_reduce_scatter(void* g, void* out, void* in, int op, void** work, char* err,
                               size_t len) {
  return start(g, work, err, len, [&](c10d::Backend& b) {
    c10d::ReduceScatterOptions o;
    o.reduceOp = reduce_op(op);
    return b._reduce_scatter_base(tensor(out), tensor(in), o);
  });
}

// `out` (size times `in`) receives every rank's `in`, in rank order.
int accrue_c10d_all_gather(void* g, void* out, void* in, void** work, char* err, size_t len) {
  return start(g, work, err, len, [&](c10d::Backend& b) {
    return b._allgather_base(tensor(out), tensor(in), c10d::AllgatherOptions());
  });
}

int accrue_c10d_broadcast(void* g, void* t, int root, void** work, char* err, size_t len) {
  return start(g, work, err, len, [&](c10d::Backend& b) {
    std::vector<at::Tensor> ts{tensor(t)};
    c10d::BroadcastOptions o;
    o.rootRank = root;
    return b.broadcast(ts, o);
  });
}

int accrue_c10d_send(void* g, void* t, int dst, int tag, void** work, char* err, size_t len) {
  return start(g, work, err, len, [&](c10d::Backend& b) {
    std::vector<at::Tensor> ts{tensor(t)};
    return b.send(ts, dst, tag);
  });
}

int accrue_c10d_recv(void* g, void* t, int src, int tag, void** work, char* err, size_t len) {
  return start(g, work, err, len, [&](c10d::Backend& b) {
    std::vector<at::Tensor> ts{tensor(t)};
    return b.recv(ts, src, tag);
  });
}

// Waits for the operation, at most timeout_ms; a failed or timed-out
// operation is -1 with its message.
int accrue_c10d_work_wait(void* w, int64_t timeout_ms, char* err, size_t len) {
  return guarded(
      [&] {
        auto* work = static_cast<Work*>(w);
        bool done = work->work->wait(std::chrono::milliseconds(timeout_ms));
        TORCH_CHECK(done, "the operation did not complete within ", timeout_ms, " ms");
      },
      err, len);
}

// 1 when the operation has finished (successfully or not), 0 otherwise.
int accrue_c10d_work_done(void* w) { return static_cast<Work*>(w)->work->isCompleted() ? 1 : 0; }

void accrue_c10d_work_free(void* w) { delete static_cast<Work*>(w); }

}  // extern "C"
