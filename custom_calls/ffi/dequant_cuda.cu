// CUDA XLA FFI handlers with the operands, attributes and results of dequant.cc, for dequantising weights on
// the GPU (checkpoint conversion on a GPU host, debugging a kernel against decoded weights). One thread per
// output element; the element and scale rules are those of dequant.h, shared with the CPU handlers.
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "dequant.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kThreads = 256;

__global__ void Fp8BlockDequantizeKernel(const uint8_t* codes, const void* scale, bool ue8m0, float* out,
                                         int64_t total, int64_t rows, int64_t cols, int64_t srows, int64_t scols,
                                         int64_t block_rows, int64_t block_cols) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= total) return;
  const int64_t k = i % cols;
  const int64_t r = (i / cols) % rows;
  const int64_t b = i / (cols * rows);
  const int64_t si = (b * srows + r / block_rows) * scols + k / block_cols;
  const float v = deepinfer::DecodeE4M3(codes[i]);
  out[i] = ue8m0 ? deepinfer::ApplyUE8M0(v, static_cast<const uint8_t*>(scale)[si])
                 : deepinfer::ApplyScaleInv(v, static_cast<const float*>(scale)[si]);
}

__global__ void Mxfp4DequantizeKernel(const uint8_t* packed, const uint8_t* scale, float* out, int64_t total_bytes,
                                      int64_t half) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= total_bytes) return;
  const int64_t r = i / half, j = i % half;
  const uint8_t byte = packed[i];
  const uint8_t sb = scale[r * (half / 16) + j / 16];
  out[2 * i] = deepinfer::ApplyUE8M0(deepinfer::DecodeE2M1(byte & 0xF), sb);
  out[2 * i + 1] = deepinfer::ApplyUE8M0(deepinfer::DecodeE2M1(byte >> 4), sb);
}

int64_t Blocks(int64_t n) { return (n + kThreads - 1) / kThreads; }

ffi::Error LaunchStatus(const char* what) {
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return ffi::Error::Internal(std::string(what) + ": " + cudaGetErrorString(err));
  return ffi::Error::Success();
}

ffi::Error Fp8BlockDequantize(cudaStream_t stream, ffi::Buffer<ffi::U8> codes, ffi::AnyBuffer scale,
                              ffi::ResultBuffer<ffi::F32> out, int64_t block_rows, int64_t block_cols) {
  const char* what = "deepinfer_fp8_block_dequantize (cuda)";
  auto cd = codes.dimensions();
  auto sd = scale.dimensions();
  if (cd.size() < 2 || cd.size() != sd.size() || block_rows < 1 || block_cols < 1) {
    return ffi::Error::InvalidArgument(std::string(what) + ": bad operand ranks or block");
  }
  const int64_t rows = cd[cd.size() - 2], cols = cd[cd.size() - 1];
  const int64_t srows = sd[sd.size() - 2], scols = sd[sd.size() - 1];
  if (srows != (rows + block_rows - 1) / block_rows || scols != (cols + block_cols - 1) / block_cols) {
    return ffi::Error::InvalidArgument(std::string(what) + ": scale shape does not match codes and block");
  }
  const bool ue8m0 = scale.element_type() == ffi::DataType::U8;
  if (!ue8m0 && scale.element_type() != ffi::DataType::F32) {
    return ffi::Error::InvalidArgument(std::string(what) + ": scale must be u8 (UE8M0) or f32 (scale_inv)");
  }
  const int64_t total = static_cast<int64_t>(codes.element_count());
  if (total == 0) return ffi::Error::Success();
  Fp8BlockDequantizeKernel<<<Blocks(total), kThreads, 0, stream>>>(codes.typed_data(), scale.untyped_data(), ue8m0,
                                                                  out->typed_data(), total, rows, cols, srows,
                                                                  scols, block_rows, block_cols);
  return LaunchStatus(what);
}

ffi::Error Mxfp4Dequantize(cudaStream_t stream, ffi::Buffer<ffi::U8> packed, ffi::Buffer<ffi::U8> scale,
                           ffi::ResultBuffer<ffi::F32> out) {
  const char* what = "deepinfer_mxfp4_dequantize (cuda)";
  auto pd = packed.dimensions();
  auto sd = scale.dimensions();
  const int64_t half = pd.size() ? pd[pd.size() - 1] : 0;
  if (pd.size() < 2 || pd.size() != sd.size() || half % 16 != 0 || sd[sd.size() - 1] != half / 16) {
    return ffi::Error::InvalidArgument(std::string(what) + ": scale shape does not match packed");
  }
  const int64_t total = static_cast<int64_t>(packed.element_count());
  if (total == 0) return ffi::Error::Success();
  Mxfp4DequantizeKernel<<<Blocks(total), kThreads, 0, stream>>>(packed.typed_data(), scale.typed_data(),
                                                               out->typed_data(), total, half);
  return LaunchStatus(what);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(DeepinferFp8BlockDequantizeCuda, Fp8BlockDequantize,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("block_rows")
                                  .Attr<int64_t>("block_cols"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(DeepinferMxfp4DequantizeCuda, Mxfp4Dequantize,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
