/* image_ops.h - shared by the two halves of the image_ops plugin. */
#ifndef IMAGE_OPS_H
#define IMAGE_OPS_H

#include "loom_plugin.h"

extern const loom_host *img_host;              /* set by init */
extern const loom_source_ops npy_source_ops;   /* npy.c */

#endif
