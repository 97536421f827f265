// The fake device moved next to the engine (csrc/cuda/fake_device.h): the
// extension builds the host-cost benchmark over it too.
#pragma once

#include "cuda/fake_device.h"
