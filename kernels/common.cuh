// Shared helpers of the moe_ep kernels, included by every kernels/*.cu. It
// includes no system header (NVRTC through CuPy has none by default):
// fixed-width types, bf16/f16 conversions by PTX.

#ifndef MOE_EP_COMMON_CUH
#define MOE_EP_COMMON_CUH

typedef unsigned short u16;
typedef unsigned int u32;
typedef long long i64;

#define MOE_EP_FULL_MASK 0xffffffffu
// RoutingHandle.recv_pos of a route that came here and was dropped for
// capacity (moe_ep/transport/layout.py's DROPPED_MEMBER; -1: no route here).
#define MOE_EP_DROPPED_MEMBER (-2)

__device__ __forceinline__ float bf16_to_f32(u16 bits) {
  return __uint_as_float(((u32)bits) << 16);
}

__device__ __forceinline__ u16 f32_to_bf16(float value) {  // round to nearest even
  u16 bits;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(bits) : "f"(value));
  return bits;
}

__device__ __forceinline__ float f16_to_f32(u16 bits) {
  float value;
  asm("cvt.f32.f16 %0, %1;" : "=f"(value) : "h"(bits));
  return value;
}

__device__ __forceinline__ u16 f32_to_f16(float value) {
  u16 bits;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(bits) : "f"(value));
  return bits;
}

__device__ __forceinline__ u32 lanemask_lt() {
  u32 mask;
  asm("mov.u32 %0, %%lanemask_lt;" : "=r"(mask));
  return mask;
}

// Bytes of dynamic shared memory this launch was given: kernels that index
// it by their arguments check them against it.
__device__ __forceinline__ u32 dynamic_shared_bytes() {
  u32 bytes;
  asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(bytes));
  return bytes;
}

// Element types of 16-bit and 32-bit float rows: load to float32, store with
// one rounding (round to nearest even). Shared by the sums (rows.cu, peer_combine.cu)
// and the FP8 passes (fp8.cu), so all of them round alike.
struct F32 {
  typedef float Elem;
  static __device__ __forceinline__ float load(float v) { return v; }
  static __device__ __forceinline__ float store(float v) { return v; }
};
struct BF16 {
  typedef u16 Elem;
  static __device__ __forceinline__ float load(u16 v) { return bf16_to_f32(v); }
  static __device__ __forceinline__ u16 store(float v) { return f32_to_bf16(v); }
};
struct F16 {
  typedef u16 Elem;
  static __device__ __forceinline__ float load(u16 v) { return f16_to_f32(v); }
  static __device__ __forceinline__ u16 store(float v) { return f32_to_f16(v); }
};

// One 16-byte vector seen as its elements of type T.
template <typename T>
union Pack16 {
  uint4 raw;
  typename T::Elem elems[16 / sizeof(typename T::Elem)];
};

#endif  // MOE_EP_COMMON_CUH
