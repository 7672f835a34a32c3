// Releasing and re-allocating a tensor's storage in place (issue 41,
// ZeRO-3): what PyTorch's FSDP does with `untyped_storage().resize_(n)`.
// A gathered unit's parameters are views of one flat buffer; the forward's
// saved tensors hold views of it too. Resizing the buffer's StorageImpl to
// 0 bytes frees the memory under every view at once; resizing it back
// (through the storage's own allocator: the CPU's, or CUDA's caching
// allocator) and refilling it gives the same views the same values for
// the backward. The contents are not kept: the caller refills them.
#include <ATen/ATen.h>
#include <c10/core/StorageImpl.h>

#include "shim.h"

extern "C" {

// t: tch's `at::Tensor*`; nbytes: the storage's new size. Returns 0, or
// -1 with libtorch's message in err.
int accrue_storage_resize(void* t, int64_t nbytes, char* err, size_t len) {
  return accrue_shim::guarded(
      [&] {
        TORCH_CHECK(nbytes >= 0, "a storage size of ", nbytes, " bytes");
        const at::Tensor& x = *static_cast<at::Tensor*>(t);
        c10::StorageImpl* s = x.storage().unsafeGetStorageImpl();
        TORCH_CHECK(s->resizable(), "the tensor's storage is not resizable");
        const auto n = static_cast<size_t>(nbytes);
        if (n == s->nbytes()) {
          return;
        }
        if (n == 0) {
          s->set_data_ptr_noswap(at::DataPtr(nullptr, s->device()));
        } else {
          at::Allocator* a = s->allocator();
          TORCH_CHECK(a != nullptr, "the tensor's storage has no allocator");
          s->set_data_ptr_noswap(a->allocate(n));
        }
        s->set_nbytes(n);
      },
      err, len);
}

// Makes `g` the `.grad` of `t` (PyTorch's `t.grad = g` without its
// checks: the caller gives a float32 tensor of t's shape on t's device).
// Setting it needs no backward and reads none of t's values, so it works
// on a parameter whose storage is released (ZeRO-3).
int accrue_set_grad(void* t, void* g, char* err, size_t len) {
  return accrue_shim::guarded(
      [&] {
        at::Tensor& x = *static_cast<at::Tensor*>(t);
        const at::Tensor& grad = *static_cast<at::Tensor*>(g);
        TORCH_CHECK(grad.sizes() == x.sizes(), "a gradient of shape ", grad.sizes(),
                    " for a parameter of shape ", x.sizes());
        x.mutable_grad() = grad;
      },
      err, len);
}

// The storage's size in bytes, or -1.
int64_t accrue_storage_nbytes(void* t) {
  try {
    return static_cast<int64_t>(static_cast<at::Tensor*>(t)->storage().nbytes());
  } catch (...) {
    return -1;
  }
}

}  // extern "C"
