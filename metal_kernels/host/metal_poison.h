// Included after metal_shim.h / metal_emu.h and right before Metal kernel sources. Metal's `thread` address
// space becomes nothing (defined only here: host code above uses std::thread), and words a Metal kernel
// cannot use become compile errors in what follows (the host definitions above were parsed already).
#define thread
#pragma GCC poison double std printf malloc calloc free new delete throw try catch
