// Element and scale decoding of the DeepSeek checkpoint formats, shared by the CPU (dequant.cc) and CUDA
// (dequant_cuda.cu) XLA FFI handlers.
//
// The results are bit-identical to deepinfer_jax/numerics/host.py, which is the specification:
//   * E4M3 bytes decode exactly (subnormals m * 2^-9 included; 0x7F / 0xFF are NaN);
//   * E2M1 nibbles decode to 0, 0.5, 1, 1.5, 2, 3, 4, 6 with a sign bit;
//   * a UE8M0 scale byte b multiplies by 2^(b - 127) (byte 255 is NaN). Every E4M3 / E2M1 value has at most four
//     significant bits, so the product is exact in double precision; a result below the smallest normal float
//     becomes a zero of the same sign (the codecs' flush rule) and one above the float range becomes infinity;
//   * a float32 scale (V3 weight_scale_inv) multiplies in float32, with the same flush.
#ifndef DEEPINFER_CUSTOM_CALLS_FFI_DEQUANT_H_
#define DEEPINFER_CUSTOM_CALLS_FFI_DEQUANT_H_

#include <cmath>
#include <cstdint>

#if defined(__CUDACC__)
#define DEEPINFER_HD __host__ __device__
#else
#define DEEPINFER_HD
#endif

namespace deepinfer {

constexpr float kMinNormal = 1.17549435e-38f;  // 2^-126

DEEPINFER_HD inline float FlushSubnormal(float x) {
  return std::fabs(x) < kMinNormal ? std::copysign(0.0f, x) : x;
}

DEEPINFER_HD inline float DecodeE4M3(uint8_t code) {
  const int e = (code >> 3) & 0xF;
  const int m = code & 0x7;
  if ((code & 0x7F) == 0x7F) return std::copysign(NAN, (code & 0x80) ? -1.0f : 1.0f);
  // An integer number of 2^-9 steps: m for subnormals, (8 + m) << (e - 1) for normals.
  const int steps = e == 0 ? m : (8 + m) << (e - 1);
  const float value = static_cast<float>(steps) * 0.001953125f;
  return (code & 0x80) ? -value : value;
}

DEEPINFER_HD inline float DecodeE2M1(uint8_t nibble) {
  const int e = (nibble >> 1) & 0x3;
  const int m = nibble & 0x1;
  const int halves = e == 0 ? m : (2 + m) << (e - 1);
  const float value = static_cast<float>(halves) * 0.5f;
  return (nibble & 0x8) ? -value : value;
}

DEEPINFER_HD inline float ApplyUE8M0(float value, uint8_t scale_byte) {
  if (scale_byte == 255) return NAN;
  const double r = static_cast<double>(value) * ldexp(1.0, static_cast<int>(scale_byte) - 127);
  return FlushSubnormal(static_cast<float>(r));
}

DEEPINFER_HD inline float ApplyScaleInv(float value, float scale) { return FlushSubnormal(value * scale); }

}  // namespace deepinfer

#endif  // DEEPINFER_CUSTOM_CALLS_FFI_DEQUANT_H_
