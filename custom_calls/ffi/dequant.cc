// CPU XLA FFI handlers that decode checkpoint weight formats to float32:
//
//   deepinfer_fp8_block_dequantize  codes u8 [..., R, C] (E4M3), scale [..., ceil(R/b0), ceil(C/b1)]
//                                   (u8 UE8M0 or f32 scale_inv), attrs block_rows, block_cols -> f32 [..., R, C]
//   deepinfer_mxfp4_dequantize      packed u8 [..., R, C/2] (low nibble first), scale u8 [..., R, C/32] (UE8M0)
//                                   -> f32 [..., R, C]
//
// Leading dimensions are batch dimensions of equal extent in every operand (the Python wrapper uses the
// "broadcast_all" vmap method, so vmap just adds one). Used for offline checkpoint conversion and inspection,
// where a single pass over a multi-gigabyte tensor in native code beats numpy's temporaries.
#include <cstdint>
#include <string>

#include "dequant.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

std::string Shape(ffi::AnyBuffer::Dimensions dims) {
  std::string s = "[";
  for (size_t i = 0; i < dims.size(); ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + "]";
}

// Checks that `a` and `b` have the same rank (at least 2) and the same leading (batch) dimensions; returns the
// number of matrices in the batch through `batch`.
ffi::Error CheckBatch(const char* what, ffi::AnyBuffer::Dimensions a, ffi::AnyBuffer::Dimensions b,
                      int64_t* batch) {
  if (a.size() < 2 || a.size() != b.size()) {
    return ffi::Error::InvalidArgument(std::string(what) + ": operands must have the same rank >= 2, got " +
                                       Shape(a) + " and " + Shape(b));
  }
  *batch = 1;
  for (size_t i = 0; i + 2 < a.size(); ++i) {
    if (a[i] != b[i]) {
      return ffi::Error::InvalidArgument(std::string(what) + ": batch dimensions differ: " + Shape(a) + " vs " +
                                         Shape(b));
    }
    *batch *= a[i];
  }
  return ffi::Error::Success();
}

ffi::Error Fp8BlockDequantize(ffi::Buffer<ffi::U8> codes, ffi::AnyBuffer scale, ffi::ResultBuffer<ffi::F32> out,
                              int64_t block_rows, int64_t block_cols) {
  const char* what = "deepinfer_fp8_block_dequantize";
  if (block_rows < 1 || block_cols < 1) {
    return ffi::Error::InvalidArgument(std::string(what) + ": block must be positive, got (" +
                                       std::to_string(block_rows) + ", " + std::to_string(block_cols) + ")");
  }
  auto cd = codes.dimensions();
  auto sd = scale.dimensions();
  int64_t batch = 0;
  if (ffi::Error err = CheckBatch(what, cd, sd, &batch); err.failure()) return err;
  const int64_t rows = cd[cd.size() - 2], cols = cd[cd.size() - 1];
  const int64_t srows = sd[sd.size() - 2], scols = sd[sd.size() - 1];
  if (srows != (rows + block_rows - 1) / block_rows || scols != (cols + block_cols - 1) / block_cols) {
    return ffi::Error::InvalidArgument(std::string(what) + ": scale " + Shape(sd) + " does not match codes " +
                                       Shape(cd) + " with block (" + std::to_string(block_rows) + ", " +
                                       std::to_string(block_cols) + ")");
  }
  const bool ue8m0 = scale.element_type() == ffi::DataType::U8;
  if (!ue8m0 && scale.element_type() != ffi::DataType::F32) {
    return ffi::Error::InvalidArgument(std::string(what) + ": scale must be u8 (UE8M0) or f32 (scale_inv)");
  }
  const uint8_t* c = codes.typed_data();
  const uint8_t* s8 = static_cast<const uint8_t*>(scale.untyped_data());
  const float* s32 = static_cast<const float*>(scale.untyped_data());
  float* o = out->typed_data();
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t srow = (b * srows + r / block_rows) * scols;
      const int64_t base = (b * rows + r) * cols;
      for (int64_t k = 0; k < cols; ++k) {
        const float v = deepinfer::DecodeE4M3(c[base + k]);
        const int64_t si = srow + k / block_cols;
        o[base + k] = ue8m0 ? deepinfer::ApplyUE8M0(v, s8[si]) : deepinfer::ApplyScaleInv(v, s32[si]);
      }
    }
  }
  return ffi::Error::Success();
}

ffi::Error Mxfp4Dequantize(ffi::Buffer<ffi::U8> packed, ffi::Buffer<ffi::U8> scale, ffi::ResultBuffer<ffi::F32> out) {
  const char* what = "deepinfer_mxfp4_dequantize";
  auto pd = packed.dimensions();
  auto sd = scale.dimensions();
  int64_t batch = 0;
  if (ffi::Error err = CheckBatch(what, pd, sd, &batch); err.failure()) return err;
  const int64_t rows = pd[pd.size() - 2], half = pd[pd.size() - 1];
  const int64_t groups = sd[sd.size() - 1];
  if (sd[sd.size() - 2] != rows || half % 16 != 0 || groups != half / 16) {
    return ffi::Error::InvalidArgument(std::string(what) + ": scale " + Shape(sd) + " does not match packed " +
                                       Shape(pd) + " (one scale byte per 16 packed bytes)");
  }
  const uint8_t* p = packed.typed_data();
  const uint8_t* s = scale.typed_data();
  float* o = out->typed_data();
  for (int64_t r = 0; r < batch * rows; ++r) {
    for (int64_t i = 0; i < half; ++i) {
      const uint8_t byte = p[r * half + i];
      const uint8_t sb = s[r * groups + i / 16];
      o[r * 2 * half + 2 * i] = deepinfer::ApplyUE8M0(deepinfer::DecodeE2M1(byte & 0xF), sb);
      o[r * 2 * half + 2 * i + 1] = deepinfer::ApplyUE8M0(deepinfer::DecodeE2M1(byte >> 4), sb);
    }
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(DeepinferFp8BlockDequantize, Fp8BlockDequantize,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("block_rows")
                                  .Attr<int64_t>("block_cols"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(DeepinferMxfp4Dequantize, Mxfp4Dequantize,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
