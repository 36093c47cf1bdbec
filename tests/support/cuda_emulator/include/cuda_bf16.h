// The CUDA emulator's __nv_bfloat16 (see ../emulator.h): the top half of an fp32, rounded to nearest even.
#pragma once
#include <cstdint>
#include <cstring>

struct __nv_bfloat16 {
  unsigned short bits;
};
inline float __bfloat162float(__nv_bfloat16 h) {
  const std::uint32_t u = static_cast<std::uint32_t>(h.bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline __nv_bfloat16 __float2bfloat16_rn(float value) {
  std::uint32_t u;
  std::memcpy(&u, &value, 4);
  __nv_bfloat16 h;
  if ((u & 0x7fffffffu) > 0x7f800000u) {  // NaN stays a (quiet) NaN
    h.bits = static_cast<unsigned short>((u >> 16) | 0x40);
  } else {
    h.bits = static_cast<unsigned short>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
  }
  return h;
}
