// The CUDA emulator's __half (see ../emulator.h): IEEE binary16 storage, converted with GCC's _Float16
// (round to nearest even, as __float2half_rn).
#pragma once
#include <cstring>

struct __half {
  unsigned short bits;
};
inline float __half2float(__half h) {
  _Float16 f;
  std::memcpy(&f, &h.bits, 2);
  return static_cast<float>(f);
}
inline __half __float2half_rn(float value) {
  const _Float16 f = static_cast<_Float16>(value);
  __half h;
  std::memcpy(&h.bits, &f, 2);
  return h;
}
