// Host emulation stand-in for CUDA's header (see cuda_host_stub.h).
#pragma once
#include "cuda_host_stub.h"
