/* AMX tiles for the plugins' C kernels: the tile configuration (palette 1) and the request for
 * the tile state, which Linux grants per process (arch_prctl; the caller defines _GNU_SOURCE
 * before its first include, for syscall() under -std=c11). plugins/_kit/cbuild.py puts this
 * directory on the include path and hashes this file into every build's key. */
#ifndef CORE_CAMX_H
#define CORE_CAMX_H
#include <stdint.h>
#include <string.h>

typedef struct {
    uint8_t palette;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* every one of the 8 tiles 16 rows of 64 bytes */
static inline void tile_config_16x64(tile_config *c) {
    memset(c, 0, sizeof *c);
    c->palette = 1;
    for (int i = 0; i < 8; i++) {
        c->rows[i] = 16;
        c->colsb[i] = 64;
    }
}

#ifdef CAMX_REQUEST
#include <sys/syscall.h>
#include <unistd.h>
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
/* 0 when this process may use the tiles (a tile instruction without it kills the process) */
static inline int amx_request_tiles(void) {
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 0 : -1;
}
#endif
#endif
