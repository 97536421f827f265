// Is a peer process still there? Used to turn a dead peer into a prompt error
// instead of a wait that runs to its full timeout.
#pragma once

#include <string>

namespace dualpipe {

//! Empty string if process `pid` is alive; otherwise why it is not
//! ("exited", "is a zombie"). A zombie counts as dead: its parent has not
//! reaped it yet but it will never write to the ring again.
std::string process_dead_reason(int pid);

}  // namespace dualpipe
