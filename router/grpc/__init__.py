"""router.grpc: the gRPC front door (proto/duet/v1/generate.proto).

Pieces (each module's docstring is its design note):
- server.py  the Generate service over a Backend
- chat.py    gRPC chats through the HTTP path's request model and shaper
- lora.py    LoadLoraAdapter / UnloadLoraAdapter under the admin-key rule
"""
