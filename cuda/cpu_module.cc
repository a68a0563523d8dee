#include "module.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(CausalConv1dForwardCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(CausalConv1dBackwardCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(CausalConv1dUpdateCpu);

NB_MODULE(_cpu, m) {
  static const causal_conv::HandlerEntry entries[] = {
      {"causal_conv1d_fwd", CausalConv1dForwardCpu},
      {"causal_conv1d_bwd", CausalConv1dBackwardCpu},
      {"causal_conv1d_update", CausalConv1dUpdateCpu},
  };
  causal_conv::define_registrations(m, entries);
}
