/* no_entry.c - a shared object without loom_plugin_entry: not a plugin. */
int loom_plugin_init(void);
int loom_plugin_init(void) { return 0; }
