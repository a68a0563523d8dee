// A channel range's weights and biases as the CPU kernels read them: in the accumulation type,
// tap-major, built once per tile (the forward and backward) or per call (the decode update).
#pragma once

#include <cstdint>

#include "conv_math.h"

namespace causal_conv {

// Weight k of channel d0 + dd of batch row b's group goes to w[k * n + dd] and its bias to
// bias[dd], so that a loop over the channels reads a tap's weights at unit stride. The group's row
// and the params' stored type are found once for the range: per element, weight_of's division by
// the group size and the type's branch took longer than a one-token decode step's arithmetic.
template <typename T, typename A, typename Params>
void param_table(const Params& p, int64_t b, int64_t d0, int64_t n, int64_t width, A* w,
                 A* bias) {
  const int64_t first = param_row_of(p, b, d0);
  with_param_type<T, A>(p.params_like_x, [&](auto like_x) {
    for (int64_t dd = 0; dd < n; ++dd) {
      for (int64_t k = 0; k < width; ++k) {
        w[k * n + dd] = load_param<T, A>(p.weight, (first + dd) * width + k, like_x);
      }
      bias[dd] = p.bias ? load_param<T, A>(p.bias, first + dd, like_x) : A(0);
    }
  });
}

}  // namespace causal_conv
