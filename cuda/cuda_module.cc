#include "module.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(CausalConv1dForwardCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(CausalConv1dBackwardCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(CausalConv1dUpdateCuda);

namespace causal_conv {
int64_t backward_workspace_elements(int64_t batch, int64_t length, int64_t channels, int64_t width);
}

NB_MODULE(_cuda, m) {
  static const causal_conv::HandlerEntry entries[] = {
      {"causal_conv1d_fwd", CausalConv1dForwardCuda},
      {"causal_conv1d_bwd", CausalConv1dBackwardCuda},
      {"causal_conv1d_update", CausalConv1dUpdateCuda},
  };
  causal_conv::define_registrations(m, entries);
  m.def("backward_workspace_elements", &causal_conv::backward_workspace_elements,
        "Elements (in the accumulation dtype) of the CUDA backward's dw/db partial-sum workspace.");
}
