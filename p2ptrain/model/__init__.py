"""p2ptrain.model"""
