// The nanobind module body shared by the CPU and CUDA extensions: a dict of FFI handler capsules
// that jax_causal_conv/_native.py registers with XLA under "jax_causal_conv_<name>", and the XLA
// FFI API version of the headers they were compiled against (XLA rejects a handler newer than its
// own API, and with it the whole backend, so _native.py compares the two first).
#pragma once

#include <nanobind/nanobind.h>

#include "xla/ffi/api/ffi.h"

namespace causal_conv {

struct HandlerEntry {
  const char* name;
  XLA_FFI_Handler* handler;
};

template <size_t N>
void define_registrations(nanobind::module_& m, const HandlerEntry (&entries)[N]) {
  m.def("registrations", [entries]() {
    nanobind::dict out;
    for (const HandlerEntry& e : entries) {
      out[e.name] = nanobind::capsule(reinterpret_cast<void*>(e.handler));
    }
    return out;
  });
  m.def("ffi_api_version",
        []() { return nanobind::make_tuple(XLA_FFI_API_MAJOR, XLA_FFI_API_MINOR); });
}

}  // namespace causal_conv
