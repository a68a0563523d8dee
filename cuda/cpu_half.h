// float16 and bfloat16 storage types for the CPU kernels, which build without CUDA's headers.
// Arithmetic happens in float (conv_math.h converts through float); these only round and widen.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace causal_conv {

inline uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}
inline float bits_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// IEEE binary16, round to nearest even.
struct Float16 {
  uint16_t bits;
  Float16() = default;
  explicit Float16(float f) : bits(encode(f)) {}
  explicit operator float() const { return decode(bits); }

  static uint16_t encode(float f) {
    const uint32_t x = float_bits(f);
    const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
    const uint32_t ax = x & 0x7fffffffu;
    if (ax >= 0x7f800000u) return sign | 0x7c00u | (ax > 0x7f800000u ? 0x200u : 0u);
    if (ax >= 0x477ff000u) return sign | 0x7c00u;  // rounds past the largest half, 65504
    if (ax < 0x38800000u) {                         // below 2^-14: subnormal half
      return sign | static_cast<uint16_t>(std::nearbyint(std::ldexp(bits_float(ax), 24)));
    }
    const uint32_t rounded = ax + 0xfffu + ((ax >> 13) & 1u);
    return sign | static_cast<uint16_t>((rounded - (112u << 23)) >> 13);
  }
  static float decode(uint16_t h) {
    const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
    const uint32_t exponent = (h >> 10) & 0x1fu;
    const uint32_t mantissa = h & 0x3ffu;
    if (exponent == 0x1f) return bits_float(sign | 0x7f800000u | (mantissa << 13));
    if (exponent != 0) return bits_float(sign | ((exponent + 112u) << 23) | (mantissa << 13));
    const float magnitude = std::ldexp(static_cast<float>(mantissa), -24);
    return sign ? -magnitude : magnitude;
  }
};

// bfloat16: the top half of a float, round to nearest even, NaN kept quiet.
struct BFloat16 {
  uint16_t bits;
  BFloat16() = default;
  explicit BFloat16(float f) : bits(encode(f)) {}
  explicit operator float() const { return bits_float(static_cast<uint32_t>(bits) << 16); }

  static uint16_t encode(float f) {
    const uint32_t x = float_bits(f);
    if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((x >> 16) | 0x40u);
    return static_cast<uint16_t>((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
  }
};

}  // namespace causal_conv
