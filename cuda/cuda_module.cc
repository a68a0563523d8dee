#include "module.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(CausalConv1dForwardCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(CausalConv1dBackwardCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(CausalConv1dUpdateCuda);

NB_MODULE(_cuda, m) {
  static const causal_conv::HandlerEntry entries[] = {
      {"causal_conv1d_fwd", CausalConv1dForwardCuda},
      {"causal_conv1d_bwd", CausalConv1dBackwardCuda},
      {"causal_conv1d_update", CausalConv1dUpdateCuda},
  };
  causal_conv::define_registrations(m, entries);
}
